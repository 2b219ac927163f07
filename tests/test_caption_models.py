"""Both captioners: teacher-forced logits equal step-by-step logits, pads stay out of the loss,
the LSTM's attention sums to 1 and never looks at padded image tokens."""

import pytest
import torch
import torch.nn.functional as F

from vitscope.caption.show_attend_tell import ShowAttendTell, ShowAttendTellConfig
from vitscope.caption.transformer import EncoderSpec, TransformerCaptioner, TransformerCaptionerConfig
from vitscope.caption.vocab import BOS, EOS, PAD


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny models here run fastest on one thread (and stay quick on a busy shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Tiny captioners (also used by test_caption_decoding): 8 x 8 images, 2 x 2 patches, 3 words, 6 positions.
VOCAB = 7  # <pad> <bos> <eos> <unk> + 3 words
MAX_LEN = 6


def tiny(kind: str, *, seed: int = 0, class_token: bool = True, memory_pos: bool = False):
    torch.manual_seed(seed)
    enc = EncoderSpec("vit_tiny_patch4_28", dict(depth=1, embed_dim=16, num_heads=2, img_size=8, patch_size=4,
                                                  class_token=class_token,
                                                  global_pool="token" if class_token else "avg"))
    if kind == "transformer":
        model = TransformerCaptioner(TransformerCaptionerConfig(vocab_size=VOCAB, encoder=enc, dim=16, depth=2,
                                                                num_heads=2, max_len=MAX_LEN, drop=0.0,
                                                                memory_pos=memory_pos))
    else:
        model = ShowAttendTell(ShowAttendTellConfig(vocab_size=VOCAB, encoder=enc, embed_dim=16, hidden_dim=16,
                                                    attn_dim=8, max_len=MAX_LEN, drop=0.0, memory_pos=memory_pos))
    # Wide random weights: distinct, confident next-token distributions (no near-ties to break).
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.4)
    return model.eval()


def images(b: int = 3, seed: int = 1):
    return torch.randn(b, 1, 8, 8, generator=torch.Generator().manual_seed(seed))


TOKENS = torch.tensor([[BOS, 4, 5, 6, EOS, PAD], [BOS, 6, 6, EOS, PAD, PAD], [BOS, 5, 4, 4, 6, EOS]])


def _stepwise(model, x, tokens, *, use_cache=True, memory_padding=None):
    """Feed the reference one token at a time through the decoding interface."""
    state = model.start(model.encode(x), memory_padding, use_cache=use_cache)
    logits, atts = [], []
    for t in range(tokens.shape[1] - 1):
        out, att, state = model.step(state)
        logits.append(out)
        atts.append(att)
        state = model.extend(state, tokens[:, t + 1])
    return torch.stack(logits, 1), torch.stack(atts, 1)


@pytest.mark.parametrize("kind", ["transformer", "lstm"])
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("memory_pos", [False, True])
def test_teacher_forced_logits_equal_step_by_step(kind, use_cache, memory_pos):
    model, x = tiny(kind, memory_pos=memory_pos), images()
    with torch.no_grad():
        forced = model(x, TOKENS)
        forced_logits = forced[0] if kind == "lstm" else forced
        step_logits, step_att = _stepwise(model, x, TOKENS, use_cache=use_cache)
    torch.testing.assert_close(step_logits, forced_logits, rtol=1e-5, atol=1e-5)
    if kind == "lstm":
        torch.testing.assert_close(step_att, forced[1], rtol=1e-6, atol=1e-6)
    else:  # each step's cross-attention is the full forward's row for that position
        _, full_att = model.decode_with_attention(TOKENS[:, :-1], model.encode(x))
        assert full_att.shape == (3, MAX_LEN - 1, 2, 2, 5)  # (B, T, L, H, 1 + 2x2 tokens)
        torch.testing.assert_close(step_att, full_att, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["transformer", "lstm"])
def test_pads_are_left_out_of_the_loss(kind):
    model, x = tiny(kind), images()
    with torch.no_grad():
        logits = model(x, TOKENS)
        logits = logits[0] if kind == "lstm" else logits
        targets = TOKENS[:, 1:]
        real = targets != PAD
        want = F.cross_entropy(logits[real], targets[real])
        got = model.losses(x, TOKENS)["xent"]
        torch.testing.assert_close(got, want)
        # whatever follows <eos> does not change the loss: the pads are ignored and, by causality,
        # never seen by a real token
        other = TOKENS.clone()
        other[other == PAD] = 0
        assert torch.equal(model.losses(x, other)["xent"], got)


def test_lstm_attention_sums_to_one_and_respects_padding():
    model, x = tiny("lstm"), images()
    padding = torch.zeros(3, 5, dtype=torch.bool)  # 1 class token + 4 patches
    padding[0, 3:] = True  # image 0 has only 3 real tokens
    padding[1, 1] = True
    with torch.no_grad():
        _, alphas = model(x, TOKENS, memory_padding=padding)  # (B, T-1, N)
        torch.testing.assert_close(alphas.sum(-1), torch.ones(3, MAX_LEN - 1))
        assert torch.all(alphas[padding[:, None].expand_as(alphas)] == 0)
        assert torch.all(alphas[~padding[:, None].expand_as(alphas)] > 0)
        # padded tokens change nothing: the same words with those tokens replaced by noise
        memory = model.encode(x)
        noisy = memory.clone()
        noisy[padding] = torch.randn(int(padding.sum()), memory.shape[-1]) * 100
        a = _step_logits(model, memory, padding)
        b = _step_logits(model, noisy, padding)
        torch.testing.assert_close(a, b)


def _step_logits(model, memory, padding):
    state = model.start(memory, padding)
    logits, _, _ = model.step(state)
    return logits


def test_doubly_stochastic_regulariser():
    model, x = tiny("lstm"), images()
    with torch.no_grad():
        _, alphas = model(x, TOKENS)
        real = (TOKENS[:, 1:] != PAD).float()[..., None]
        want = ((1 - (alphas * real).sum(1)) ** 2).sum(1).mean() * model.config.attention_reg
        terms = model.losses(x, TOKENS)
        torch.testing.assert_close(terms["attention_reg"], want)
        torch.testing.assert_close(terms["loss"], terms["xent"] + terms["attention_reg"])


@pytest.mark.parametrize("kind", ["transformer", "lstm"])
def test_gradients_reach_the_encoder(kind):
    model, x = tiny(kind).train(), images()
    model.loss(x, TOKENS).backward()
    grads = [p.grad for p in model.encoder.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and any(float(g.abs().sum()) > 0 for g in grads)


def test_average_pooled_encoders_give_normalised_tokens():
    model = tiny("transformer", class_token=False)
    assert model.num_prefix_tokens == 0 and model.grid == (2, 2)
    with torch.no_grad():
        memory = model.encode(images())
    assert memory.shape == (3, 4, 16)
    assert VOCAB == model.decoder.vocab_size


@pytest.mark.parametrize("kind", ["transformer", "lstm"])
def test_weight_decay_only_on_matrices(kind):
    model = tiny(kind)
    decay, no_decay = model.param_groups(0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert all(model.get_parameter(n).ndim >= 2 for n in decayed)
    assert not decayed & model.no_weight_decay() and "encoder.pos_embed" in model.no_weight_decay()
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("kind", ["transformer", "lstm"])
def test_memory_positions_start_as_the_2d_sincos_table_added_to_every_image_token(kind):
    from vitscope.positional import sincos_2d

    torch.manual_seed(0)
    enc = EncoderSpec("vit_tiny_patch4_28", dict(depth=1, embed_dim=16, num_heads=2, img_size=8, patch_size=4))
    config = (TransformerCaptionerConfig(vocab_size=VOCAB, encoder=enc, dim=16, depth=1, num_heads=2, max_len=MAX_LEN,
                                         memory_pos=True) if kind == "transformer" else
              ShowAttendTellConfig(vocab_size=VOCAB, encoder=enc, embed_dim=16, hidden_dim=16, attn_dim=8,
                                   max_len=MAX_LEN, memory_pos=True))
    model = (TransformerCaptioner if kind == "transformer" else ShowAttendTell)(config).eval()
    table = model.memory_pos.table  # (1, 1 + 2 x 2, 16): the class token, then the patches in reading order
    assert torch.equal(table[0, 0], torch.zeros(16))
    torch.testing.assert_close(table[0, 1:], sincos_2d(2, 2, 16), rtol=0, atol=0)
    x = images()
    with torch.no_grad():
        plain = model.encoder.forward_features(x)
        plain = plain if model.encoder.fc_norm is None or isinstance(model.encoder.fc_norm, torch.nn.Identity) \
            else model.encoder.fc_norm(plain)
        torch.testing.assert_close(model.encode(x) - plain, table.expand(3, -1, -1), rtol=0, atol=1e-6)
    assert "memory_pos.table" in model.no_weight_decay()
