"""Translation, where attention began: a synthetic language pair with known word alignments, the RNN
encoder-decoder with additive (Bahdanau) attention, the same RNN without attention (one context vector), and a
transformer encoder-decoder, decoded by captioning's greedy and beam search and measured by exact sentence
accuracy, token accuracy, BLEU and alignment accuracy.

    language.py     the pair: rule-governed reordering, disjoint train/test sentences, gold alignments
    rnn.py          bidirectional GRU encoder; GRU decoder with AdditiveAttention, or with one context vector
    transformer.py  pre-norm encoder + vitscope.decoder.TransformerDecoder
    builders.py     the pair as tensors and vocabularies; translators by name
    metrics.py      exact match, token accuracy, BLEU-4, alignment accuracy, accuracy by length
    evaluate.py     decode a split and score it
    run.py          open a trained translator; the report a run writes
    plots.py        the alignment heatmap and accuracy against length (matplotlib Figures)
"""

from vitscope.translate.builders import ParallelData, build_translator, describe
from vitscope.translate.evaluate import TranslationEvaluation, evaluate_translations
from vitscope.translate.language import Example, LanguagePair, make_pair, rule_translate
from vitscope.translate.metrics import accuracy_by_length, alignment_accuracy, bleu4, exact_match, token_accuracy
from vitscope.translate.plots import accuracy_by_length_figure, alignment_figure
from vitscope.translate.rnn import RNNTranslator, RNNTranslatorConfig
from vitscope.translate.run import TranslatorRun, open_translator
from vitscope.translate.transformer import TransformerTranslator, TransformerTranslatorConfig

__all__ = [
    "Example", "LanguagePair", "ParallelData", "RNNTranslator", "RNNTranslatorConfig", "TransformerTranslator",
    "TransformerTranslatorConfig", "TranslationEvaluation", "TranslatorRun", "accuracy_by_length",
    "accuracy_by_length_figure", "alignment_accuracy", "alignment_figure", "bleu4", "build_translator", "describe",
    "evaluate_translations", "exact_match", "make_pair", "open_translator", "rule_translate", "token_accuracy",
]
