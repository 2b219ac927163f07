"""The same numbers on a CUDA GPU: vitscope's attention, layers, models and training loop against the
references there (float64 on the CPU, torch.nn.MultiheadAttention, transformers' ViT, timm's own outputs,
the same step on the CPU).

On a GPU vitscope runs none of its C kernels: attention is PyTorch's fused kernel and the layers are
PyTorch's CUDA ops, so these tests hold the model code around them to the references. Every test is
skipped where torch sees no CUDA GPU (the CI machines); on a GPU machine: `pytest tests/test_cuda.py`.
TF32 is off in every test, so float32 means float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import torch_mha_like
from vitscope.attention import MultiHeadAttention, attend
from vitscope.models import create_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_float32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖, in float64 on the CPU."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape
    assert torch.isfinite(got).all()
    return ((got - want).norm() / want.norm()).item()


def explicit64(q, k, v, scale=None):
    """softmax(q kᵀ · scale) v in float64 on the CPU: the reference (differentiable where its inputs are)."""
    q, k, v = (t.double().cpu() for t in (q, k, v))
    s = scale if scale is not None else q.shape[-1] ** -0.5
    return torch.softmax(q @ k.transpose(-1, -2) * s, dim=-1) @ v


# bfloat16 operands put 1e-3 to 1e-2 between a result and float64; float32 stays near 1e-6.
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [65, 197, 1025])
def test_attend_matches_float64_forward_and_backward(dtype, n):
    gen = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (torch.randn(3, 6, n, 64, device=CUDA, generator=gen, dtype=dtype).requires_grad_() for _ in range(3))
    g = torch.randn(3, 6, n, 64, device=CUDA, generator=gen, dtype=dtype)
    out = attend(q, k, v)
    out.backward(g)
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    ref = explicit64(q64, k64, v64)
    ref.backward(g.double().cpu())
    assert out.dtype == dtype and out.device.type == "cuda"
    assert rel(out, ref) < TOL[dtype]
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert rel(got, want) < 2 * TOL[dtype]


def test_attend_weights_and_masks_on_cuda():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 50, 32, device=CUDA, generator=gen) for _ in range(3))
    out, w = attend(q, k, v, return_weights=True)
    ref_w = torch.softmax(q.double().cpu() @ k.double().cpu().transpose(-1, -2) / 32**0.5, dim=-1)
    assert rel(w, ref_w) < 1e-5 and rel(out, ref_w @ v.double().cpu()) < 1e-5
    # causal: the fused path on the GPU against the masked float64 softmax
    causal = attend(q, k, v, causal=True)
    s = q.double().cpu() @ k.double().cpu().transpose(-1, -2) / 32**0.5
    s = s.masked_fill(torch.ones(50, 50, dtype=torch.bool).triu(1), float("-inf"))
    assert rel(causal, torch.softmax(s, -1) @ v.double().cpu()) < 1e-5


def test_multi_head_attention_matches_torch_module_with_gradients():
    torch.manual_seed(0)
    ours = MultiHeadAttention(384, 6).to(CUDA)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ref = torch_mha_like(ours, 384, 6).to(CUDA)
    x = torch.randn(4, 197, 384, device=CUDA)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a = ours(xa)
    b = ref(xb, xb, xb, need_weights=False)[0]
    assert rel(a, b) < 1e-5
    g = torch.randn_like(a)
    a.backward(g)
    b.backward(g)
    # float32 sums of 384 products in another order: 2e-5 seen on a CPU for the input's gradient
    assert rel(xa.grad, xb.grad) < 1e-4
    assert rel(ours.qkv.weight.grad, ref.in_proj_weight.grad) < 1e-4
    assert rel(ours.proj.weight.grad, ref.out_proj.weight.grad) < 1e-4


FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("timm_*.safetensors"))


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_timm_checkpoints_reproduce_timms_outputs_on_cuda(path):
    from safetensors.torch import load_file

    from vitscope.vit import VisionTransformer, ViTConfig
    from vitscope.weights.model_io import load_timm_state_dict, read_metadata

    t = load_file(path)
    model = VisionTransformer(ViTConfig.from_dict(json.loads(read_metadata(path)["config"]))).eval()
    load_timm_state_dict(model, {k: v for k, v in t.items() if k.startswith("model.")})
    model.to(CUDA)
    with torch.no_grad():
        logits = model(t["input"].to(CUDA))
        features = model.forward_features(t["input"].to(CUDA))
    # timm's outputs were written on a CPU in float32: the GPU's float32 sums in another order
    assert rel(features, t["features"]) < 2e-5
    assert rel(logits, t["logits"]) < 2e-5


def test_transformers_vit_gives_the_same_logits_on_cuda():
    transformers = pytest.importorskip("transformers")
    from vitscope.vit import VisionTransformer
    from vitscope.weights.hf import hf_to_vitscope

    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=224, patch_size=16, num_channels=3, hidden_size=96,
                                 num_hidden_layers=2, num_attention_heads=3, intermediate_size=384, num_labels=5)
    hf = transformers.ViTForImageClassification(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    ours_cfg, sd = hf_to_vitscope(hf.state_dict(), hf.config.to_dict())
    ours = VisionTransformer(ours_cfg)
    ours.load_state_dict(sd, strict=True)
    ours.eval().to(CUDA)
    hf.to(CUDA)
    x = torch.randn(4, 3, 224, 224, device=CUDA)
    with torch.no_grad():
        want = hf(pixel_values=x).logits
        got = ours(x)
        assert rel(got, want) < 1e-5
        # bfloat16 autocast, as the benchmarks run both: the same function within bfloat16 rounding
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got16 = ours(x)
    assert rel(got16, want) < 3e-2


def _grads(model, x, y) -> tuple[float, dict[str, torch.Tensor]]:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["vit_fmnist_quick", "vit_tiny_patch4_28"])
def test_a_training_step_on_cuda_matches_the_cpu(name):
    """Loss and every gradient of one float32 training step (the conv stem's BatchNorm in training mode
    too) on the GPU against the same step on the CPU."""
    torch.manual_seed(0)
    cpu = create_model(name, depth=2).train()
    gpu = create_model(name, depth=2).train()
    gpu.load_state_dict(cpu.state_dict())
    gpu.to(CUDA)
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    loss_cpu, g_cpu = _grads(cpu, x, y)
    loss_gpu, g_gpu = _grads(gpu, x.to(CUDA), y.to(CUDA))
    assert abs(loss_cpu - loss_gpu) < 1e-5 * max(1.0, abs(loss_cpu))
    for k, g in g_cpu.items():
        assert rel(g_gpu[k], g) < 1e-4, k
    buffers = gpu.state_dict()  # BatchNorm's running statistics, updated by the step
    for k, v in cpu.state_dict().items():
        if "running" in k:
            assert rel(buffers[k], v) < 1e-5, k


def test_bf16_autocast_training_on_cuda_fits_a_batch():
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", depth=2).to(CUDA)
    x, y = torch.randn(64, 1, 28, 28, device=CUDA), torch.arange(64, device=CUDA) % 10
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, fused=True)
    for _ in range(120):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert loss.item() < 0.1
    assert (model(x).argmax(1) == y).float().mean() > 0.95


def test_compiled_model_on_cuda_gives_the_eager_numbers():
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", depth=2).to(CUDA).eval()
    x = torch.randn(8, 1, 28, 28, device=CUDA)
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model)(x)
    assert rel(got, want) < 1e-5


def test_capture_takes_images_from_the_cpu_for_a_model_on_the_gpu():
    from vitscope.inspect.capture import capture_attention

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", depth=2).eval()
    x = torch.randn(3, 1, 28, 28)
    want = capture_attention(model, x)
    got = capture_attention(model.to(CUDA), x)
    assert got.output.device.type == "cpu" and rel(got.output, want.output) < 1e-5
    for name in want.names:
        assert got[name].device.type == "cpu" and rel(got[name], want[name]) < 1e-5


def test_compile_options_compile_a_vit_s16_training_step():
    """torch 2.11's Inductor asserted in its coalesce tiling analysis on this step; compile_options turns it off."""
    from vitscope.training.loop import compile_options

    torch.manual_seed(0)
    model = create_model("vit_small_patch16_224", num_classes=10, depth=2).to(CUDA)
    net = torch.compile(model, options=compile_options(CUDA))
    x, y = torch.randn(8, 3, 224, 224, device=CUDA), torch.randint(0, 10, (8,), device=CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        F.cross_entropy(net(x), y).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_training_run_on_cuda_learns_and_its_checkpoint_loads_on_the_cpu(tmp_path):
    pytest.importorskip("sklearn")
    from vitscope.data.transforms import TrainTransform
    from vitscope.training.loop import TrainConfig, train
    from vitscope.training.options import ImageOptions
    from vitscope.weights.model_io import load_model

    tiny = {"img_size": 8, "patch_size": 2, "embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0,
            "class_token": False, "global_pool": "avg"}
    image = ImageOptions(model="vit_tiny_patch4_28", model_args=tiny, augment=TrainTransform(crop="none", flip=False))
    cfg = TrainConfig(image=image, dataset="digits", epochs=8, batch_size=64, lr=1e-2, warmup_epochs=0.3,
                      amp="auto", device="cuda", explain_images=2)
    res = train(cfg, tmp_path, progress=False)
    assert res.value > 0.6  # 10 classes: chance is 0.1
    for name in ("summary.json", "best.safetensors", "curves.png", "explorer.html"):  # the explorer: CPU images
        assert (tmp_path / name).is_file(), name
    model = load_model(tmp_path / "last.safetensors")  # saved from the GPU, loaded on the CPU
    assert next(model.parameters()).device.type == "cpu"
    gpu = load_model(tmp_path / "last.safetensors", map_location=CUDA)
    x = torch.randn(16, 1, 8, 8)
    with torch.no_grad():
        assert rel(gpu(x.to(CUDA)), model(x)) < 1e-5
