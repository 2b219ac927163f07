"""`vitscope data list | verify NAME | prepare NAME`: the datasets vitscope reads, their files checked."""

from __future__ import annotations


def add_data_parser(sub) -> None:
    p = sub.add_parser("data", help="list, verify or prepare datasets",
                       description="list: the datasets vitscope reads; verify NAME: check files (counts, shapes, "
                                   "checksums); prepare NAME: find or download and verify.")
    p.add_argument("action", choices=["list", "verify", "prepare"])
    p.add_argument("name", nargs="?", default="fashion_mnist")
    p.add_argument("--root", help="where the dataset's files are")
    p.set_defaults(run=run_data)


def run_data(args) -> int:
    from vitscope.data import list_datasets, load_dataset, verify_dataset

    if args.action == "list":
        for name in list_datasets():
            print(name)
        return 0
    if args.action == "prepare":
        for split in ("train", "test"):
            ds = load_dataset(args.name, split, root=args.root)
            print(f"{args.name} {split}: {len(ds)} images of {tuple(ds.images.shape[1:])}, {len(ds.classes)} classes")
    for line in verify_dataset(args.name, args.root):
        print(line)
    return 0
