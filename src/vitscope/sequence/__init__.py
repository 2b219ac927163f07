"""What every image-to-text and text-to-text task shares; it imports no task, and captioning
(vitscope.caption) and translation (vitscope.translate) both build on it.

    vocab.py       word-level tokenisation and the Vocabulary (`<pad>` `<bos>` `<eos>` `<unk>`)
    decoding.py    the step protocol (StepModel), greedy decoding and the standard beam search, DecodeOptions
    steps.py       DecoderSteps: the step protocol for any model whose decoder is vitscope's TransformerDecoder
    loss.py        the teacher-forced cross-entropy with pads left out, and the one trim of padded batches
    bleu.py        corpus BLEU-1..4 as the COCO caption evaluation computes it
    evaluation.py  the mode every evaluator runs a model in
"""

from vitscope.sequence.bleu import corpus_bleu
from vitscope.sequence.decoding import Decoded, DecodeOptions, StepModel, beam_search, decode, greedy
from vitscope.sequence.evaluation import evaluating
from vitscope.sequence.loss import masked_xent, sequence_losses, token_counts, trim_padding
from vitscope.sequence.steps import DecoderState, DecoderSteps
from vitscope.sequence.vocab import BOS, EOS, PAD, UNK, Vocabulary, detokenize, tokenize

__all__ = [
    "BOS", "EOS", "PAD", "UNK", "DecodeOptions", "Decoded", "DecoderState", "DecoderSteps", "StepModel", "Vocabulary",
    "beam_search", "corpus_bleu", "decode", "detokenize", "evaluating", "greedy", "masked_xent", "sequence_losses",
    "token_counts", "tokenize", "trim_padding",
]
