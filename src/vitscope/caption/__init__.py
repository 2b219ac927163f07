"""Image captioning, the attention lecture end to end: data, two captioners, decoding, metrics, pictures.

    dataset.py           CaptionDataset: uint8 images and their reference captions
    readers.py           COCO captions, Karpathy split files, Flickr8k tokens
    scenes.py            Fashion-MNIST scenes: captioned canvases of items on a grid, every cell recorded
    transformer.py       ViT encoder -> Transformer decoder with cross-attention
    show_attend_tell.py  the LSTM-with-additive-attention baseline
    metrics.py           CIDEr-D as the COCO evaluation computes it (BLEU is vitscope.sequence's); grounding
    evaluate.py          decode a split and score it
    builders.py          data by name, captioners by config, the vocabulary with the checkpoint
    plots.py             one panel per generated word with where it looked; the caption explorer (matplotlib)

The vocabulary, greedy and beam decoding, the masked loss and BLEU are vitscope.sequence's, shared with
translation; they are re-exported here so a captioning user finds them in one place.
"""

from vitscope.caption.builders import CaptionTaskConfig, load_caption_dataset
from vitscope.caption.dataset import CaptionDataset
from vitscope.caption.evaluate import CaptionEvaluation, evaluate_captions
from vitscope.caption.metrics import attention_grounding, cider_d, score_captions
from vitscope.caption.readers import load_coco, load_flickr8k, load_karpathy
from vitscope.caption.scenes import Scene, ScenesConfig, exact_match, item_accuracy, load_scenes, parse_caption
from vitscope.caption.show_attend_tell import ShowAttendTell, ShowAttendTellConfig
from vitscope.caption.transformer import EncoderSpec, TransformerCaptioner, TransformerCaptionerConfig
from vitscope.sequence import (
    BOS,
    EOS,
    PAD,
    UNK,
    Decoded,
    Vocabulary,
    beam_search,
    corpus_bleu,
    decode,
    greedy,
    tokenize,
)

__all__ = [
    "BOS", "EOS", "PAD", "UNK", "CaptionDataset", "CaptionEvaluation", "CaptionTaskConfig", "Decoded",
    "EncoderSpec", "Scene", "ScenesConfig", "ShowAttendTell", "ShowAttendTellConfig", "TransformerCaptioner",
    "TransformerCaptionerConfig", "Vocabulary", "attention_grounding", "beam_search", "cider_d", "corpus_bleu",
    "decode", "evaluate_captions", "exact_match", "greedy", "item_accuracy", "load_caption_dataset", "load_coco",
    "load_flickr8k", "load_karpathy", "load_scenes", "parse_caption", "score_captions", "tokenize",
]
