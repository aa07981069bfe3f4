"""Unit tests for the pure math helpers in ppo.py.

Every helper is checked against an independent naive implementation written here with plain Python loops over
float64 values (lists and the math module). The naive code never calls the helper under test and does not copy its
vectorised code. Inputs come from seeded torch generators, in several shapes and edge cases. Where the spec
(/work/shared/reference/ppo-anchors.md, A.2, A.5, A.6 and the "10 details" list) defines semantics, they are
asserted directly as well.
"""
import itertools
import math
import random

import pytest
import torch

import ppo
from ppo_harness.forwards import head_logprobs

F64 = dict(rtol=1e-10, atol=1e-12)  # float64 helpers vs float64 loops
F32 = dict(rtol=1e-5, atol=1e-6)  # helpers that compute in float32
CLIPFRAC = dict(rtol=1e-6, atol=1e-7)  # clip fractions are computed as float32 ((bool).float()), a count ratio


# ------------------------------------------------------------------------------------------------------------------
# Shared random inputs and small list utilities
# ------------------------------------------------------------------------------------------------------------------
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, seed, scale=1.0, dtype=torch.float64) -> torch.Tensor:
    return (torch.randn(shape, generator=gen(seed), dtype=torch.float64) * scale).to(dtype)


def rand_mask(shape, seed, p_true=0.6, min_true=2) -> torch.Tensor:
    """A random bool mask with at least `min_true` True entries (the first ones in flattened order are forced)."""
    m = torch.rand(shape, generator=gen(seed + 1000)) < p_true
    flat = m.view(-1)
    flat[:min_true] = True
    return m


def rand_seq_lengths(batch, response_length, seed) -> torch.Tensor:
    """Index of the last real token per row, in [-1, R-1] (-1: the response is all padding). Row 0 has >= 1 token and
    the extremes -1 and R-1 are included whenever the batch is large enough."""
    s = torch.randint(-1, response_length, (batch,), generator=gen(seed + 2000))
    s[0] = max(0, int(s[0]))
    if batch >= 3:
        s[1], s[2] = -1, response_length - 1
    return s


def rows(t: torch.Tensor) -> list[list]:
    """The tensor as a list of rows over its last dim (a layout change only, no arithmetic)."""
    return t.reshape(-1, t.size(-1)).tolist()


def from_rows(values: list, like: torch.Tensor, drop_last_dim: bool = False, dtype=torch.float64) -> torch.Tensor:
    shape = like.shape[:-1] if drop_last_dim else like.shape
    return torch.tensor(values, dtype=dtype).reshape(shape)


def assert_close(actual: torch.Tensor, expected, tol=F64):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), expected, **tol)


# ------------------------------------------------------------------------------------------------------------------
# Naive reference implementations (one per concept)
# ------------------------------------------------------------------------------------------------------------------
def naive_first_true(row: list[bool]) -> int:
    for i, b in enumerate(row):
        if b:
            return i
    return len(row)


def naive_log_softmax_at(row: list[float], k: int) -> float:
    m = max(row)
    s = sum(math.exp(x - m) for x in row)
    return (row[k] - m) - math.log(s)  # log(exp(l_k - m) / s), without underflow for very negative l_k


def naive_probs(row: list[float]) -> list[float]:
    m = max(row)
    e = [math.exp(x - m) for x in row]
    s = sum(e)
    return [x / s for x in e]


def naive_entropy(row: list[float]) -> float:
    return -sum(p * math.log(p) for p in naive_probs(row) if p > 0)


def naive_mean(values: list[float], mask: list[bool]) -> float:
    kept = [v for v, m in zip(values, mask) if m]
    return sum(kept) / len(kept)


def naive_var(values: list[float], mask: list[bool], unbiased: bool) -> float:
    kept = [v for v, m in zip(values, mask) if m]
    mu = sum(kept) / len(kept)
    ss = sum((v - mu) ** 2 for v in kept)
    return ss / (len(kept) - 1) if unbiased else ss / len(kept)


def naive_whiten(values: list[float], mask: list[bool], shift_mean: bool) -> list[float]:
    mu, var = naive_mean(values, mask), naive_var(values, mask, unbiased=True)
    out = [(v - mu) / math.sqrt(var + 1e-8) for v in values]  # ALL entries, stats from the unmasked ones
    return out if shift_mean else [o + mu for o in out]


def naive_score_position(seq_len: int, response_length: int) -> int:
    return seq_len + 1 if seq_len + 1 < response_length else seq_len


def naive_k1(lp: float, ref: float) -> float:
    return lp - ref


def naive_k3(lp: float, ref: float) -> float:
    r = math.exp(ref - lp)
    return (r - 1) - math.log(r)


def naive_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list, list]:
    n = len(rewards)
    adv = [0.0] * n
    next_adv, next_value = 0.0, 0.0  # V_R = 0, A_R = 0
    for t in range(n - 1, -1, -1):
        delta = rewards[t] + gamma * next_value - values[t]
        adv[t] = delta + gamma * lam * next_adv
        next_adv, next_value = adv[t], values[t]
    return adv, [a + v for a, v in zip(adv, values)]


def clip(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


def naive_policy_loss(new, old, adv, pad, c):
    """Per-token loop over unmasked tokens. Returns (loss, clipfrac, approxkl, ratio_mean, grad wrt new)."""
    n = sum(1 for p in pad if not p)
    loss = clipped = kl = ratio_sum = 0.0
    grad = [0.0] * len(new)
    for i, (nl, ol, a, p) in enumerate(zip(new, old, adv, pad)):
        if p:
            continue
        ratio = math.exp(nl - ol)
        unclipped_loss, clipped_loss = -a * ratio, -a * clip(ratio, 1 - c, 1 + c)
        loss += max(unclipped_loss, clipped_loss)
        clipped += clipped_loss > unclipped_loss
        kl += (nl - ol) ** 2
        ratio_sum += ratio
        # d/dnew of -a*ratio is -a*ratio; the clipped branch is constant in `new` when it is strictly the larger one
        grad[i] = 0.0 if clipped_loss > unclipped_loss else -a * ratio / n
    return loss / n, clipped / n, 0.5 * kl / n, ratio_sum / n, grad


def naive_value_loss(v, old, ret, pad_p1, c):
    """Returns (loss, clipfrac, grad wrt vpred)."""
    n = sum(1 for p in pad_p1 if not p)
    loss = clipped = 0.0
    grad = [0.0] * len(v)
    for i, (vi, oi, ri, p) in enumerate(zip(v, old, ret, pad_p1)):
        if p:
            continue
        l1, l2 = (vi - ri) ** 2, (clip(vi, oi - c, oi + c) - ri) ** 2
        loss += max(l1, l2)
        clipped += l2 > l1
        grad[i] = 0.0 if l2 > l1 else (vi - ri) / n  # d/dv of 0.5 * (v - R)^2 / n
    return 0.5 * loss / n, clipped / n, grad


def naive_batch_sizes(per_device, ga, n_mini, world, total):
    local_mini = per_device * ga
    local_batch = local_mini * n_mini
    batch = local_batch * world
    updates, covered = 0, 0
    while covered < total:  # the number of updates needed to sample at least `total` episodes
        covered += batch
        updates += 1
    return world, local_mini, local_batch, local_mini * world, batch, updates


# ------------------------------------------------------------------------------------------------------------------
# first_true_indices / truncate_response
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (4, 1), (3, 8), (7, 33), (2, 3, 5)])
@pytest.mark.parametrize("p_true", [0.0, 0.1, 0.5, 1.0])
def test_first_true_indices(shape, p_true):
    bools = torch.rand(shape, generator=gen(sum(shape) + int(10 * p_true))) < p_true
    out = ppo.first_true_indices(bools)
    assert out.shape == bools.shape[:-1] and out.dtype == torch.long
    expected = [naive_first_true(r) for r in rows(bools)]
    assert out.reshape(-1).tolist() == expected
    if p_true == 0.0:
        assert all(e == shape[-1] for e in expected)  # no True: the row length
    if p_true == 1.0:
        assert all(e == 0 for e in expected)


@pytest.mark.parametrize("shape", [(1, 1), (5, 1), (4, 9), (16, 24)])
@pytest.mark.parametrize("stop,pad", [(0, 9), (3, 9), (2, 2)])  # (2, 2): pad == stop
@pytest.mark.parametrize("seed", [0, 1])
def test_truncate_response(shape, stop, pad, seed):
    responses = torch.randint(0, 6, shape, generator=gen(seed))
    if shape[0] > 1:
        responses[0] = torch.where(responses[0] == stop, (stop + 1) % 6, responses[0])  # a row with no stop token
    before = responses.clone()
    out = ppo.truncate_response(stop, pad, responses)
    assert torch.equal(responses, before), "input modified in place"
    expected = []
    for r in responses.tolist():
        first = naive_first_true([tok == stop for tok in r])
        expected.append([tok if t <= first else pad for t, tok in enumerate(r)])  # stop token itself is kept
    assert out.tolist() == expected
    for r_in, r_out in zip(responses.tolist(), out.tolist()):
        if stop not in r_in:
            assert r_in == r_out  # rows without a stop token are unchanged
        else:
            assert r_out[r_in.index(stop)] == stop


# ------------------------------------------------------------------------------------------------------------------
# scale_logits / logprobs_from_logits / entropy_from_logits
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(3, 7), (2, 4, 11), (1, 1, 2)])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.01])
@pytest.mark.parametrize("pad_offset", [0, 1, "last", "vocab", "beyond"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_scale_logits(shape, temperature, pad_offset, in_dtype):
    vocab = shape[-1]
    pad = {"last": vocab - 1, "vocab": vocab, "beyond": vocab + 5}.get(pad_offset, pad_offset)
    logits = randn(shape, seed=vocab, scale=3.0, dtype=in_dtype)
    before = logits.clone()
    out = ppo.scale_logits(logits, temperature, pad)
    assert torch.equal(logits, before) and logits.dtype == in_dtype, "input modified in place"
    assert out.dtype == torch.promote_types(in_dtype, torch.float32) and out.shape == logits.shape  # float32 or wider
    fmin = torch.finfo(out.dtype).min
    out_rows, in_rows = rows(out), rows(logits.double())
    for o, x in zip(out_rows, in_rows):
        for j in range(vocab):
            if j == pad:
                assert o[j] == fmin
            else:
                assert math.isclose(o[j], x[j] / (temperature + 1e-7), rel_tol=1e-6, abs_tol=1e-30)
        if pad < vocab:
            assert naive_probs(o)[pad] == 0.0  # pad is never sampled
            assert all(math.isfinite(v) for v in o)


@pytest.mark.parametrize("shape", [(1, 1, 1), (4, 6), (3, 5, 13), (2, 8, 50)])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_logprobs_from_logits(shape, scale):
    logits = randn(shape, seed=sum(shape), scale=scale)
    tokens = torch.randint(0, shape[-1], shape[:-1], generator=gen(7))
    out = ppo.logprobs_from_logits(logits, tokens)
    assert out.shape == tokens.shape and out.dtype == torch.float64
    expected = [naive_log_softmax_at(r, k) for r, k in zip(rows(logits), tokens.reshape(-1).tolist())]
    assert_close(out, from_rows(expected, logits, drop_last_dim=True))
    assert (out <= 0).all()


def test_logprobs_after_scale_logits_with_pad_column():
    """float32 path used by ppo.py: the pad column holds the dtype min; its logprob is hugely negative, others finite."""
    logits = randn((3, 5, 9), seed=11, scale=2.0, dtype=torch.float32)
    pad = 4
    scaled = ppo.scale_logits(logits, 0.8, pad)
    tokens = torch.randint(0, 9, (3, 5), generator=gen(12))
    tokens[0, 0] = pad
    out = ppo.logprobs_from_logits(scaled, tokens)
    expected = [naive_log_softmax_at(r, k) for r, k in zip(rows(scaled.double()), tokens.reshape(-1).tolist())]
    assert_close(out, from_rows(expected, scaled, drop_last_dim=True), tol=F32)
    assert out[0, 0] < -1e37
    assert torch.isfinite(out[tokens != pad]).all()


@pytest.mark.parametrize("shape", [(1, 2), (4, 6), (3, 5, 13), (2, 8, 50)])
@pytest.mark.parametrize("scale", [0.1, 1.0, 30.0])
def test_entropy_from_logits(shape, scale):
    logits = randn(shape, seed=3 * sum(shape), scale=scale)
    out = ppo.entropy_from_logits(logits)
    assert out.shape == logits.shape[:-1]
    expected = [naive_entropy(r) for r in rows(logits)]
    assert_close(out, from_rows(expected, logits, drop_last_dim=True))
    assert (out >= -1e-12).all() and (out <= math.log(shape[-1]) + 1e-12).all()


def test_entropy_is_accurate_over_a_large_vocabulary():
    """SmolLM2's 49,152 logits at T = 0.7, in float32: within 1e-5 of a float64 loop (logsumexp(l) - sum(p l) was 5e-4
    off, which made the fused head's start-up check fail on the default model)."""
    logits = randn((2, 49152), seed=11, scale=4.0) / 0.7
    logits[:, :8] += 25.0  # a few likely tokens, as a language model's
    expected = [naive_entropy(r) for r in rows(logits.double())]
    assert_close(ppo.entropy_from_logits(logits), expected, tol=dict(rtol=0, atol=1e-5))


@pytest.mark.parametrize("vocab", [1, 2, 17])
def test_entropy_closed_forms(vocab):
    uniform = torch.full((2, vocab), 0.3, dtype=torch.float64)
    assert_close(ppo.entropy_from_logits(uniform), [math.log(vocab)] * 2)
    peaked = torch.zeros(1, vocab, dtype=torch.float64)
    peaked[0, 0] = 1e4  # all mass on one token
    assert_close(ppo.entropy_from_logits(peaked), [0.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_entropy_finite_with_dtype_min_logit(dtype):
    """scale_logits writes finfo.min into the pad column: the entropy must stay finite and ignore that column."""
    logits = randn((4, 3, 10), seed=5, dtype=dtype)
    logits[..., 2] = torch.finfo(dtype).min
    out = ppo.entropy_from_logits(logits)
    assert torch.isfinite(out).all()
    expected = [naive_entropy(r[:2] + r[3:]) for r in rows(logits.double())]
    assert_close(out, from_rows(expected, logits, drop_last_dim=True), tol=F32 if dtype == torch.float32 else F64)
    scaled = ppo.scale_logits(randn((4, 10), seed=6), 0.7, pad_token_id=9)
    assert torch.isfinite(ppo.entropy_from_logits(scaled)).all()



@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_entropy_gradient_against_a_loop_with_dtype_min_logit(scale):
    """d entropy / d logit_j = -p_j (log p_j + entropy), 0 in the pad column (finfo.min), finite even when the loss
    scales the entropy up (an entropy bonus under fp16 loss scaling: before, the pad column's gradient overflowed)."""
    logits = randn((3, 7), seed=8, dtype=torch.float32)
    logits[:, 4] = torch.finfo(torch.float32).min
    logits.requires_grad_()
    (scale * ppo.entropy_from_logits(logits).sum()).backward()
    expected = []
    for r in rows(logits.detach().double()):
        finite = r[:4] + r[5:]
        m = max(finite)
        log_z = m + math.log(sum(math.exp(x - m) for x in finite))
        entropy = -sum(math.exp(x - log_z) * (x - log_z) for x in finite)
        expected.append([0.0 if j == 4 else -scale * math.exp(x - log_z) * (x - log_z + entropy)
                         for j, x in enumerate(r)])
    assert torch.isfinite(logits.grad).all()
    assert_close(logits.grad, from_rows(expected, logits), tol=dict(rtol=1e-4, atol=1e-5 * scale))


# ------------------------------------------------------------------------------------------------------------------
# head_logprobs (the LM head over vocabulary blocks: log-softmax, gather, entropy, chunked; README: the ledger)
# ------------------------------------------------------------------------------------------------------------------
def naive_head_logits(h: list[float], weight: list[list[float]], temperature: float, pad: int) -> list[float]:
    """One row of scale_logits(h @ W.T), with the pad column removed from the distribution (probability 0)."""
    out = [sum(a * b for a, b in zip(h, w)) / (temperature + 1e-7) for w in weight]
    return [(-math.inf if j == pad else x) for j, x in enumerate(out)]


def naive_logp_and_entropy(logits: list[float], k: int) -> tuple[float, float]:
    finite = [x for x in logits if x > -math.inf]
    m = max(finite)
    log_z = m + math.log(sum(math.exp(x - m) for x in finite))
    return logits[k] - log_z, -sum(math.exp(x - log_z) * (x - log_z) for x in finite)


HEAD_CASES = [  # (rows, hidden, vocab, pad, chunk_elements): chunk_elements // rows words per block
    (5, 3, 7, 7, 7),  # pad outside the vocabulary, one word per block
    (6, 4, 9, 2, 20),  # pad inside, 3 words per block
    (4, 2, 5, 4, 10**6),  # pad the last column, the whole vocabulary in one block
    (7, 3, 6, 0, 28),  # 4 words per block, the last block short
    (5, 3, 7, 0, 5),  # the pad alone in the first block: the running sums start from a block with no word
]


@pytest.mark.parametrize("n, hidden, vocab, pad, chunk", HEAD_CASES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_logprobs(n, hidden, vocab, pad, chunk, temperature):
    h, w = randn((n, hidden), seed=n, scale=2.0), randn((vocab, hidden), seed=vocab)
    tokens = torch.randint(0, vocab, (n,), generator=gen(hidden))
    tokens[tokens == pad] = (pad + 1) % vocab  # ppo.py never asks for the pad token
    lp, ent = head_logprobs(h, w, tokens, temperature, pad, with_entropy=True, chunk_elements=chunk)
    expected = [naive_logp_and_entropy(naive_head_logits(hr, rows(w), temperature, pad), k)
                for hr, k in zip(rows(h), tokens.tolist())]
    assert_close(lp, [e[0] for e in expected])
    assert_close(ent, [e[1] for e in expected])
    lp_only, empty = head_logprobs(h, w, tokens, temperature, pad, chunk_elements=chunk)
    assert_close(lp_only, lp) and empty.numel() == 0


@pytest.mark.parametrize("n, hidden, vocab, pad, chunk", HEAD_CASES)
@pytest.mark.parametrize("uses", ["logprobs", "entropy", "both"])
def test_head_logprobs_gradients(n, hidden, vocab, pad, chunk, uses):
    """Gradients of sum_i c_i logprob_i + e_i entropy_i against a loop: d logprob_i / d logit_ij = (1[j = token_i] -
    p_ij) / T and d entropy_i / d logit_ij = -p_ij (log p_ij + entropy_i) / T, zero in the pad column (its logit is a
    constant), chained through logit_ij = h_i . w_j. A loss may use either output alone (an entropy bonus)."""
    temperature = 0.7
    h = randn((n, hidden), seed=n + 1).requires_grad_()
    w = randn((vocab, hidden), seed=vocab + 1).requires_grad_()
    tokens = torch.randint(0, vocab, (n,), generator=gen(hidden + 1))
    tokens[tokens == pad] = (pad + 1) % vocab
    c = randn((n,), seed=3) * (uses != "entropy")
    e = randn((n,), seed=4) * (uses != "logprobs")
    lp, ent = head_logprobs(h, w, tokens, temperature, pad, with_entropy=True, chunk_elements=chunk)
    assert lp.requires_grad and ent.requires_grad
    {"logprobs": (lp * c).sum(), "entropy": (ent * e).sum(), "both": (lp * c).sum() + (ent * e).sum()}[uses].backward()
    W, H = rows(w.detach()), rows(h.detach())
    grad_h = [[0.0] * hidden for _ in range(n)]
    grad_w = [[0.0] * hidden for _ in range(vocab)]
    for i in range(n):
        logits = naive_head_logits(H[i], W, temperature, pad)
        finite = [x for x in logits if x > -math.inf]
        m = max(finite)
        log_z = m + math.log(sum(math.exp(x - m) for x in finite))
        entropy = -sum(math.exp(x - log_z) * (x - log_z) for x in finite)
        for j in range(vocab):
            if j == pad:
                continue
            p = math.exp(logits[j] - log_z)
            d = c[i].item() * ((1.0 if j == tokens[i].item() else 0.0) - p)
            d += e[i].item() * -p * (logits[j] - log_z + entropy)
            d /= temperature + 1e-7
            for k in range(hidden):
                grad_h[i][k] += d * W[j][k]
                grad_w[j][k] += d * H[i][k]
    assert_close(h.grad, grad_h)
    assert_close(w.grad, grad_w)


def test_head_logprobs_matches_the_unfused_float32_path():
    """ppo.py's fused path against scale_logits -> logprobs_from_logits / entropy_from_logits on the same logits."""
    h, w = randn((3, 4, 8), seed=1, dtype=torch.float32), randn((50, 8), seed=2, scale=3.0, dtype=torch.float32)
    tokens = torch.randint(0, 49, (3, 4), generator=gen(3))
    lp, ent = head_logprobs(h, w, tokens, 0.7, 49, with_entropy=True, chunk_elements=100)
    logits = ppo.scale_logits(h @ w.T, 0.7, 49)
    assert lp.shape == ent.shape == tokens.shape and lp.dtype == torch.float32
    torch.testing.assert_close(lp, ppo.logprobs_from_logits(logits, tokens), **F32)
    # lse - sum p l (unfused) cancels where the entropy is small; -sum p log p (fused) does not: an absolute bound
    torch.testing.assert_close(ent, ppo.entropy_from_logits(logits), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_head_logprobs_under_bf16_autocast_matches_the_unfused_path(seed):
    """Under accelerate's autocast the forward's logsumexp comes from bf16 logits; the backward runs outside autocast,
    so it must recompute the logits the same way, or the softmax it forms does not sum to 1 and the gradients drift
    (by 7% of their scale before the fix). Peaked rows (confident tokens), as a trained policy has."""
    h = randn((64, 32), seed=seed, scale=3.0, dtype=torch.float32).requires_grad_()
    w = randn((50, 32), seed=seed + 10, scale=0.5, dtype=torch.float32).requires_grad_()
    tokens = torch.randint(0, 50, (64,), generator=gen(seed + 20))
    g = randn((64,), seed=seed + 30, dtype=torch.float32)

    def plain():
        logits = ppo.scale_logits(h @ w.T, 0.7, 51)
        return ppo.logprobs_from_logits(logits, tokens), ppo.entropy_from_logits(logits)

    results = []
    for path in (plain, lambda: head_logprobs(h, w, tokens, 0.7, 51, with_entropy=True, chunk_elements=500)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, ent = path()
        results.append((lp.detach(), ent.detach(), *torch.autograd.grad((lp * g).sum(), (h, w))))
    for fused, plain_ in zip(results[1], results[0]):  # within bf16 rounding of each tensor's scale
        torch.testing.assert_close(fused, plain_, rtol=2e-2, atol=2e-2 * plain_.abs().max().item())


# ------------------------------------------------------------------------------------------------------------------
# sample_next: inverse-CDF sampling
# ------------------------------------------------------------------------------------------------------------------


def naive_inverse_cdf(p: list[float], u: float) -> int:
    total = sum(p)
    acc = 0.0
    for j, x in enumerate(p):
        acc += x
        if acc > u * total:
            return j
    return len(p) - 1


def sample_next_with(logits, uniforms, pad_token_id, monkeypatch):
    """`sample_next`'s tokens and log-probs (temperature 1) where torch.rand draws `uniforms`."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch, "rand", lambda *shape, **kwargs: uniforms.clone())
    finished = torch.zeros(logits.size(0), dtype=torch.bool)
    token, logprob, _, _ = ppo.sample_next(logits, SimpleNamespace(temperature=1.0), pad_token_id, None, finished,
                                           None, False)
    monkeypatch.undo()
    return token, logprob


@pytest.mark.parametrize("vocab", [1, 2, 13])
def test_sample_next_inverse_cdf(vocab, monkeypatch):
    """The token of each row's uniform under the inverse CDF of softmax(scale_logits(logits)), against a loop in
    float64; [PAD] (probability 0) never drawn, the edges of [0, 1) included."""
    logits = randn((50, vocab), seed=vocab, scale=3.0).float()
    pad = vocab // 2 if vocab > 1 else vocab  # a zero-probability token (the pad column) ...
    logits[0] = torch.finfo(torch.float32).min
    logits[0, -1] = 0.0  # ... and a row whose only mass is on the last token
    u = torch.rand(50, generator=gen(vocab))
    u[1], u[2] = 0.0, 1.0 - 2**-24  # the edges of [0, 1) in float32
    token, logprob = sample_next_with(logits, u, pad, monkeypatch)
    probs = torch.softmax(ppo.scale_logits(logits, 1.0, pad), -1).double()
    assert token.shape == (50, 1)
    expected = [naive_inverse_cdf(p, x) for p, x in zip(rows(probs), u.double().tolist())]
    assert token.squeeze(-1).tolist() == expected
    if vocab > 1:
        assert (token[1:] != pad).all()  # row 0 puts its mass on the last token
    naive = [math.log(p[t]) for p, t in zip(rows(probs), expected)]
    assert_close(logprob.double(), torch.tensor(naive, dtype=torch.float64), tol=dict(rtol=1e-5, atol=1e-5))


def test_sample_next_frequencies():
    """Drawn with the generator's uniforms, the tokens follow the distribution (binomial 5-sigma bounds)."""
    from types import SimpleNamespace

    p = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    n = 100_000
    logits = p.log().expand(n, 5).clone()  # log 0 = -inf: the second word is never drawn
    token, _, _, _ = ppo.sample_next(logits, SimpleNamespace(temperature=1.0), 5, gen(0),
                                     torch.zeros(n, dtype=torch.bool), None, False)
    counts = torch.bincount(token.squeeze(-1), minlength=5).tolist()
    assert counts[1] == 0
    for c, q in zip(counts, p.tolist()):
        assert abs(c - n * q) <= 5 * math.sqrt(n * q * (1 - q)) + 1e-9


# ------------------------------------------------------------------------------------------------------------------
# masked_mean / masked_whiten
# ------------------------------------------------------------------------------------------------------------------
SHAPES_2D = [(1, 2), (3, 5), (4, 17), (16, 64)]


@pytest.mark.parametrize("shape", SHAPES_2D)
@pytest.mark.parametrize("p_true", [0.2, 0.7, 1.0])
def test_masked_mean(shape, p_true):
    values = randn(shape, seed=shape[1], scale=5.0)
    mask = rand_mask(shape, seed=shape[0], p_true=p_true)
    mask[:, 0] = True  # at least one unmasked entry
    assert_close(ppo.masked_mean(values, mask), naive_mean(values.view(-1).tolist(), mask.view(-1).tolist()))
    # masked entries do not matter at all
    other = values.masked_fill(~mask, 1e6)
    assert_close(ppo.masked_mean(other, mask), ppo.masked_mean(values, mask))
    # per row (dim=1): each row's own mean, a row with nothing unmasked 0
    mask[-1] = False
    rows = ppo.masked_mean(values, mask, dim=1)
    for r, (v, m) in enumerate(zip(values.tolist(), mask.tolist())):
        assert_close(rows[r], naive_mean(v, m) if any(m) else 0.0)


@pytest.mark.parametrize("shape", SHAPES_2D)
@pytest.mark.parametrize("p_true", [0.3, 1.0])
@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("scale,offset", [(1.0, 0.0), (40.0, -7.0), (1e-3, 3.0)])
def test_masked_whiten(shape, p_true, shift_mean, scale, offset):
    values = randn(shape, seed=20 + shape[0], scale=scale) + offset
    mask = rand_mask(shape, seed=21 + shape[1], p_true=p_true)
    out = ppo.masked_whiten(values, mask, shift_mean=shift_mean)
    v, m = values.view(-1).tolist(), mask.view(-1).tolist()
    # x - mean cancels when |x| >> std: rounding in the mean is amplified by max|x| / std (conditioning, not a bug)
    cond = max(1.0, max(abs(x) for x in v) / math.sqrt(naive_var(v, m, unbiased=True)))
    expected = torch.tensor(naive_whiten(v, m, shift_mean), dtype=torch.float64).view(shape)
    assert_close(out, expected, tol=dict(rtol=1e-10, atol=1e-12 * cond))
    # semantics on the unmasked entries: mean 0 (or the original mean) and unbiased variance ~1
    o = out.view(-1).tolist()
    target_mean = 0.0 if shift_mean else naive_mean(v, m)
    var_in = naive_var(v, m, unbiased=True)
    assert math.isclose(naive_mean(o, m), target_mean, abs_tol=1e-9 * max(1.0, abs(target_mean)))
    assert math.isclose(naive_var(o, m, unbiased=True), var_in / (var_in + 1e-8), rel_tol=1e-9)
    if var_in > 1e-4:
        assert math.isclose(naive_var(o, m, unbiased=True), 1.0, rel_tol=1e-3)



@pytest.mark.parametrize("n_real", [0, 1, 2, 7])
@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_as_the_advantages_use_it(n_real, shift_mean):
    """main's advantages, `masked_whiten` over the real tokens then 0 at padding (float64 loop); under two real
    tokens (one response of one token on a process) there is no spread: a lone one is centred (its own value when the
    mean is added back), nothing is NaN."""
    advantages = randn((2, 5), seed=30 + n_real, scale=2.0) + 1.0
    padding_mask = torch.ones(2, 5, dtype=torch.bool)
    padding_mask.view(-1)[:n_real] = False
    out = ppo.masked_whiten(advantages, ~padding_mask, shift_mean).masked_fill(padding_mask, 0)
    v, m = advantages.view(-1).tolist(), (~padding_mask).view(-1).tolist()
    if n_real >= 2:
        expected = naive_whiten(v, m, shift_mean)
    else:
        expected = [0.0 if shift_mean else x for x in v]
    expected = [e if keep else 0.0 for e, keep in zip(expected, m)]
    assert_close(out, torch.tensor(expected, dtype=torch.float64).view(2, 5), tol=dict(rtol=1e-9, atol=1e-9))

# ------------------------------------------------------------------------------------------------------------------
# kl_penalty / compute_rewards
# ------------------------------------------------------------------------------------------------------------------
def naive_padding_masks(seq_lens: list[int], response_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """main's padding_mask (past the last real token) and padding_mask_p1 (past the score's position)."""
    pm = [[t > s for t in range(response_length)] for s in seq_lens]
    pm1 = [[t > s + 1 for t in range(response_length)] for s in seq_lens]
    return torch.tensor(pm, dtype=torch.bool), torch.tensor(pm1, dtype=torch.bool)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (8, 33)])
@pytest.mark.parametrize("estimator", ["k1", "k3"])
@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])
def test_kl_penalty(shape, estimator, scale):
    logprobs = -randn(shape, seed=shape[1], scale=2.0).abs()
    ref_logprobs = logprobs + randn(shape, seed=shape[0] + 50, scale=scale)
    pad = rand_mask(shape, seed=3, p_true=0.3, min_true=0)
    logprobs = logprobs.masked_fill(pad, ppo.INVALID_LOGPROB)
    ref_logprobs = ref_logprobs.masked_fill(pad, ppo.INVALID_LOGPROB)
    out = ppo.kl_penalty(logprobs, ref_logprobs, estimator)
    naive = naive_k1 if estimator == "k1" else naive_k3
    expected = [naive(a, b) for a, b in zip(logprobs.view(-1).tolist(), ref_logprobs.view(-1).tolist())]
    assert_close(out, torch.tensor(expected, dtype=torch.float64).view(shape))
    assert (out[pad] == 0).all()  # both logprobs equal INVALID_LOGPROB there
    if estimator == "k3":
        assert (out >= 0).all()


def test_kl_penalty_unknown_estimator():
    x = randn((2, 3), seed=0)
    for bad in ["full", "K1", "", "kl"]:  # full needs the logits (ppo.full_kl)
        with pytest.raises(ValueError):
            ppo.kl_penalty(x, x, bad)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_estimators_are_unbiased_for_kl_p_q(estimator):
    """x ~ p: mean of k(log p(x), log q(x)) -> KL(p || q). Tolerance: 5 standard errors, computed exactly."""
    p = [0.5, 0.2, 0.15, 0.1, 0.05]
    q = [0.1, 0.3, 0.2, 0.25, 0.15]
    kl_pq = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    kl_qp = sum(qi * math.log(qi / pi) for pi, qi in zip(p, q))
    naive = naive_k1 if estimator == "k1" else naive_k3
    per_cat = [naive(math.log(pi), math.log(qi)) for pi, qi in zip(p, q)]
    second_moment = sum(pi * k * k for pi, k in zip(p, per_cat))
    n = 200_000
    tol = 5 * math.sqrt(second_moment - kl_pq**2) / math.sqrt(n)
    assert abs(kl_pq - kl_qp) > 5 * tol and kl_pq > 5 * tol  # the check can tell KL(p||q) from KL(q||p) and from 0
    x = torch.multinomial(torch.tensor(p, dtype=torch.float64), n, replacement=True, generator=gen(123))
    logp, logq = torch.tensor(p, dtype=torch.float64).log()[x], torch.tensor(q, dtype=torch.float64).log()[x]
    estimate = ppo.kl_penalty(logp, logq, estimator).mean().item()
    assert abs(estimate - kl_pq) < tol, (estimate, kl_pq, tol)


@pytest.mark.parametrize("batch,response_length", [(1, 1), (4, 2), (6, 8), (16, 40)])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05, 1.3])
def test_compute_rewards(batch, response_length, kl_coef):
    seq = rand_seq_lengths(batch, response_length, seed=batch)
    kl = randn((batch, response_length), seed=response_length, scale=0.5)
    scores = randn((batch,), seed=batch + 99, scale=2.0)
    kl_before = kl.clone()
    rewards, non_score = ppo.compute_rewards(scores, kl, kl_coef, seq)
    assert torch.equal(kl, kl_before), "kl modified in place"
    ns = [[-kl_coef * k for k in row] for row in kl.tolist()]
    expected = [list(row) for row in ns]
    for i, (s, score) in enumerate(zip(seq.tolist(), scores.tolist())):
        expected[i][naive_score_position(s, response_length)] += score
    assert_close(non_score, ns)
    assert_close(rewards, expected)


# ------------------------------------------------------------------------------------------------------------------
# compute_gae
# ------------------------------------------------------------------------------------------------------------------
GAMMA_LAM = [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (1.0, 0.0), (0.5, 1.0), (0.0, 0.7)]


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (8, 33)])
@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
def test_compute_gae(shape, gamma, lam):
    rewards, values = randn(shape, seed=shape[1]), randn(shape, seed=shape[1] + 1, scale=2.0)
    r_before, v_before = rewards.clone(), values.clone()
    adv, ret = ppo.compute_gae(rewards, values, gamma, lam)
    assert torch.equal(rewards, r_before) and torch.equal(values, v_before), "input modified in place"
    expected = [naive_gae(r, v, gamma, lam) for r, v in zip(rewards.tolist(), values.tolist())]
    assert_close(adv, [a for a, _ in expected])
    assert_close(ret, [r for _, r in expected])


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_compute_gae_closed_forms(gamma):
    """lam=1: A_t = sum_k gamma^(k-t) r_k - V_t (Monte Carlo); lam=0: A_t = r_t + gamma V_{t+1} - V_t (one-step TD)."""
    rewards, values = randn((5, 12), seed=40), randn((5, 12), seed=41)
    n = rewards.size(1)
    r, v = rewards.tolist(), values.tolist()
    mc = [[sum(gamma ** (k - t) * row[k] for k in range(t, n)) - vrow[t] for t in range(n)] for row, vrow in zip(r, v)]
    td = [[row[t] + gamma * (vrow[t + 1] if t + 1 < n else 0.0) - vrow[t] for t in range(n)] for row, vrow in zip(r, v)]
    assert_close(ppo.compute_gae(rewards, values, gamma, 1.0)[0], mc)
    assert_close(ppo.compute_gae(rewards, values, gamma, 0.0)[0], td)
    adv, ret = ppo.compute_gae(rewards, values, gamma, 1.0)
    if gamma == 1.0:  # returns are the reward-to-go
        assert_close(ret, [[sum(row[t:]) for t in range(n)] for row in r])


# ------------------------------------------------------------------------------------------------------------------
# policy_loss / value_loss
# ------------------------------------------------------------------------------------------------------------------
LOSS_SHAPES = [(1, 1), (3, 5), (8, 16), (16, 40)]


def loss_inputs(shape, seed, noise):
    """(old logprobs, new logprobs, advantages, values-like, padding_mask, padding_mask_p1) in float64."""
    seq = rand_seq_lengths(shape[0], shape[1], seed)
    pm, pm1 = naive_padding_masks(seq.tolist(), shape[1])
    old = -randn(shape, seed=seed, scale=2.0).abs()
    new = old + randn(shape, seed=seed + 1, scale=noise)
    adv = randn(shape, seed=seed + 2)
    return old, new, adv, pm, pm1


@pytest.mark.parametrize("shape", LOSS_SHAPES)
@pytest.mark.parametrize("cliprange", [0.2, 0.05, 10.0])
@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_policy_loss(shape, cliprange, noise):
    old, new, adv, pm, _ = loss_inputs(shape, seed=shape[1], noise=noise)
    new = new.clone().requires_grad_(True)
    loss, clipfrac, approxkl, ratio_mean = ppo.policy_loss(new, old, adv, pm, cliprange)
    loss.backward()
    flat = [x.reshape(-1).tolist() for x in (new.detach(), old, adv, pm)]
    e_loss, e_clip, e_kl, e_ratio, e_grad = naive_policy_loss(*flat, cliprange)
    for got, want in [(loss, e_loss), (approxkl, e_kl), (ratio_mean, e_ratio)]:
        assert_close(got.detach(), want)
    assert_close(clipfrac, e_clip, tol=CLIPFRAC)
    assert_close(new.grad.reshape(-1), e_grad)
    assert (new.grad[pm] == 0).all()  # no gradient through padding
    if noise == 0.0:  # ratio exactly 1: nothing is clipped and approxkl is 0
        assert clipfrac == 0 and approxkl == 0 and ratio_mean == 1
    n_real = int((~pm).sum())
    if noise > 0 and cliprange == 0.05 and n_real >= 20:
        assert 0 < e_clip < 1, "the inputs should exercise both the clipped and the unclipped branch"


@pytest.mark.parametrize("shape", LOSS_SHAPES[1:])
def test_policy_loss_gradient_zero_where_clipped(shape):
    old, new, adv, pm, _ = loss_inputs(shape, seed=7 * shape[1], noise=0.5)
    new = new.clone().requires_grad_(True)
    ppo.policy_loss(new, old, adv, pm, 0.1)[0].backward()
    ratio = (new.detach() - old).exp()
    clipped_active = (-adv * ratio.clamp(0.9, 1.1)) > (-adv * ratio)
    assert clipped_active[~pm].any()
    assert (new.grad[clipped_active | pm] == 0).all()
    assert (new.grad[~clipped_active & ~pm] != 0).all()


@pytest.mark.parametrize("shape", LOSS_SHAPES)
def test_policy_loss_ignores_masked_positions(shape):
    old, new, adv, pm, _ = loss_inputs(shape, seed=3 * shape[1], noise=0.3)
    base = ppo.policy_loss(new, old, adv, pm, 0.2)
    sign = torch.where(randn(shape, seed=9) > 0, 1.0, -1.0).double()
    huge = ppo.policy_loss(new.masked_fill(pm, 200.0), old.masked_fill(pm, -200.0),
                           torch.where(pm, sign * 1e100, adv), pm, 0.2)
    for a, b in zip(base, huge):
        assert torch.equal(a, b), (a, b)


@pytest.mark.parametrize("shape", LOSS_SHAPES)
@pytest.mark.parametrize("cliprange_value", [0.2, 0.05, 10.0])
def test_value_loss(shape, cliprange_value):
    _, _, _, _, pm1 = loss_inputs(shape, seed=shape[0] + 3, noise=0.0)
    old_values = randn(shape, seed=shape[1] + 4)
    vpred = (old_values + randn(shape, seed=shape[1] + 5, scale=0.3)).requires_grad_(True)
    returns = randn(shape, seed=shape[1] + 6)
    loss, clipfrac = ppo.value_loss(vpred, old_values, returns, pm1, cliprange_value)
    loss.backward()
    flat = [x.reshape(-1).tolist() for x in (vpred.detach(), old_values, returns, pm1)]
    e_loss, e_clip, e_grad = naive_value_loss(*flat, cliprange_value)
    assert_close(loss.detach(), e_loss)
    assert_close(clipfrac, e_clip, tol=CLIPFRAC)
    assert_close(vpred.grad.reshape(-1), e_grad)
    n_real = int((~pm1).sum())
    if cliprange_value == 0.05 and n_real >= 20:
        assert 0 < e_clip < 1, "the inputs should exercise both the clipped and the unclipped branch"
    # masked positions do not matter
    huge = ppo.value_loss(vpred.detach().masked_fill(pm1, 1e100), old_values.masked_fill(pm1, -1e100),
                          returns.masked_fill(pm1, 3e99), pm1, cliprange_value)
    assert torch.equal(huge[0], loss.detach()) and torch.equal(huge[1], clipfrac)


# ------------------------------------------------------------------------------------------------------------------
# batch_sizes
# ------------------------------------------------------------------------------------------------------------------
BATCH_FLAGS = ["per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches", "world_size",
               "total_episodes"]


def test_batch_sizes_grid():
    for args in itertools.product([1, 2, 3], [1, 4], [1, 2, 3], [1, 2, 8], [1, 7, 64, 1000, 1001]):
        got = ppo.batch_sizes(*args)
        assert isinstance(got, ppo.BatchSizes)
        assert tuple(got) == naive_batch_sizes(*args), args
        assert got.world_size == args[3]
        # semantics: minibatches tile the batch; the updates cover total_episodes without a spare update
        assert got.mini_batch_size * args[2] == got.batch_size
        assert (got.num_updates - 1) * got.batch_size < args[4] <= got.num_updates * got.batch_size


@pytest.mark.parametrize("flag", BATCH_FLAGS)
@pytest.mark.parametrize("bad", [0, -1])
def test_batch_sizes_rejects_values_below_one(flag, bad):
    kwargs = dict(zip(BATCH_FLAGS, [2, 2, 2, 1, 16]))
    kwargs[flag] = bad
    kebab = "--" + "-".join(flag.split("_"))
    with pytest.raises(ValueError, match=kebab):
        ppo.batch_sizes(**kwargs)


# ------------------------------------------------------------------------------------------------------------------
# left_pad
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("pad", [0, 31])
def test_left_pad(seed, pad):
    rng = random.Random(seed)
    seqs = [[rng.randrange(1, 30) for _ in range(rng.randint(0 if seed else 1, 9))] for _ in range(rng.randint(1, 6))]
    if seed == 3:
        seqs.append([])  # an empty prompt becomes all padding
    out = ppo.left_pad(seqs, pad)
    width = 0
    for s in seqs:
        width = max(width, len(s))
    expected = []
    for s in seqs:
        row = [pad for _ in range(width - len(s))]
        row.extend(s)
        expected.append(row)
    assert out.dtype == torch.long and out.shape == (len(seqs), width)
    assert out.tolist() == expected
