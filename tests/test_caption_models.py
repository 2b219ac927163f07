"""Both captioners: teacher-forced logits equal step-by-step logits, pads stay out of the loss,
the LSTM's attention sums to 1 and never looks at padded image tokens."""

import pytest
import torch
import torch.nn.functional as F

from vitscope.caption.show_attend_tell import ShowAttendTell, ShowAttendTellConfig
from vitscope.caption.transformer import EncoderSpec, TransformerCaptioner, TransformerCaptionerConfig
from vitscope.sequence.vocab import BOS, EOS, PAD


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


def test_loss_is_the_papers_objective_per_word():
    """Xu et al. eq. 14 written plainly, caption by caption: -sum_t log p(y_t) + lambda * sum_i (1 - sum_t
    alpha_ti)^2, summed over the batch and divided by its real target words."""
    model, x = tiny("lstm"), images()
    model.config.attention_reg = 0.7
    with torch.no_grad():
        logits, alphas = model(x, TOKENS)  # the step-by-step reference, every step run
        total, words = 0.0, 0
        for b in range(len(TOKENS)):
            coverage = torch.zeros(alphas.shape[-1])
            for t in range(TOKENS.shape[1] - 1):
                target = int(TOKENS[b, t + 1])
                if target == PAD:
                    continue
                total -= float(F.log_softmax(logits[b, t], -1)[target])
                coverage += alphas[b, t]
                words += 1
            total += 0.7 * float(((1 - coverage) ** 2).sum())
        terms = model.losses(x, TOKENS)
    assert float(terms["loss"]) == pytest.approx(total / words, rel=1e-5)
    assert float(terms["xent"] + terms["attention_reg"]) == pytest.approx(total / words, rel=1e-5)


def _ragged_tokens(b: int, t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t - 1, (b,), generator=g)  # words before <eos>
    tokens = torch.full((b, t), PAD)
    tokens[:, 0] = BOS
    for i, n in enumerate(lengths.tolist()):
        tokens[i, 1:n + 1] = torch.randint(4, VOCAB, (n,), generator=g)
        tokens[i, n + 1] = EOS
    return tokens[:, : int(lengths.max()) + 2]


@pytest.mark.parametrize("padded_memory", [False, True])
def test_packed_steps_give_the_masked_loss_and_its_gradients(padded_memory):
    """Training runs each caption only to its end (rows sorted by length, the batch shrinking); the loss and
    every gradient must equal those of running every row for the longest caption's steps."""
    model, x = tiny("lstm").train(), images(5, seed=3)
    tokens = _ragged_tokens(5, MAX_LEN, seed=4)
    padding = None
    if padded_memory:
        padding = torch.zeros(5, 5, dtype=torch.bool)
        padding[1, 2:] = True

    def masked_reference():
        logits, alphas = model.teacher_forced(model.encode(x), tokens, memory_padding=padding)
        targets = tokens[:, 1:]
        real = targets != PAD
        xent = F.cross_entropy(logits[real], targets[real])
        coverage = (alphas * real[..., None]).sum(1)
        gap = (1 - coverage) ** 2
        if padding is not None:
            gap = gap.masked_fill(padding, 0.0)
        return xent + model.config.attention_reg * gap.sum() / real.sum()

    names = [n for n, p in model.named_parameters()]
    model.zero_grad()
    want = masked_reference()
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    got = model.losses(x, tokens, memory_padding=padding)["loss"]
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, p, g in zip(names, model.parameters(), want_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6, msg=name)


def test_alignment_finds_the_one_token_that_holds_the_answer():
    """The decoder alone on a synthetic memory: 16 noise tokens, one of which carries one of 3 words' vectors;
    the caption is that word. Trained briefly, the alignment of the word's step must peak on that token."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    n, d = 16, 16
    model = ShowAttendTell(ShowAttendTellConfig(
        vocab_size=VOCAB, encoder=EncoderSpec("vit_tiny_patch4_28", dict(depth=1, embed_dim=d, num_heads=2)),
        embed_dim=16, hidden_dim=32, attn_dim=16, max_len=MAX_LEN, drop=0.0, attention_reg=1.0))
    words = torch.randn(3, d, generator=g) * 2

    def batch(b):
        k, pos = torch.randint(0, 3, (b,), generator=g), torch.randint(0, n, (b,), generator=g)
        memory = torch.randn(b, n, d, generator=g)
        memory[torch.arange(b), pos] += words[k]
        return memory, torch.stack([torch.full((b,), BOS), 4 + k, torch.full((b,), EOS)], 1), pos

    opt = torch.optim.Adam([p for name, p in model.named_parameters() if not name.startswith("encoder.")], lr=3e-3)
    for _ in range(150):
        memory, tokens, _ = batch(64)
        opt.zero_grad()
        model.memory_losses(memory, tokens)["loss"].backward()
        opt.step()
    with torch.no_grad():
        memory, tokens, pos = batch(500)
        logits, alphas = model.teacher_forced(memory, tokens)
    assert (logits[:, 0].argmax(-1) == tokens[:, 1]).float().mean() > 0.95
    assert (alphas[:, 0].argmax(-1) == pos).float().mean() > 0.9  # chance: 1 in 16


def test_stem_memory_is_the_patch_grid_in_the_scenes_cell_order():
    """memory="stem": the patch embedding's grid before any block, normalised, no class token; a patch lit
    alone moves only its own token, and that token lies in the lit cell (metrics.peak_cells)."""
    from vitscope.caption.metrics import peak_cells

    torch.manual_seed(0)
    enc = EncoderSpec("vit_tiny_patch4_28", dict(depth=1, embed_dim=16, num_heads=2, img_size=8, patch_size=4))
    model = ShowAttendTell(ShowAttendTellConfig(vocab_size=VOCAB, encoder=enc, embed_dim=16, hidden_dim=16,
                                                attn_dim=8, max_len=MAX_LEN, memory="stem")).eval()
    assert model.num_prefix_tokens == 0
    blank = torch.zeros(1, 1, 8, 8)
    with torch.no_grad():
        x = images()
        conv = model.encoder.patch_embed.proj(x).flatten(2).transpose(1, 2)  # (B, 4, 16) row-major, as torch lays it
        torch.testing.assert_close(model.encode(x), F.layer_norm(conv, (16,)))
        for cell, (r, c) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
            lit = blank.clone()
            lit[..., 4 * r:4 * r + 4, 4 * c:4 * c + 4] = 3.0
            moved = (model.encode(lit) - model.encode(blank)).norm(dim=-1)[0]  # (4,)
            assert int((moved > 1e-6).sum()) == 1
            assert int(peak_cells(moved, model.grid, (8, 8), 2)) == cell


def test_config_refuses_an_unknown_memory_in_one_line():
    from vitscope.errors import ConfigError

    with pytest.raises(ConfigError, match="memory must be one of tokens, stem, got 'pixels'"):
        ShowAttendTellConfig(vocab_size=VOCAB, memory="pixels")


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
