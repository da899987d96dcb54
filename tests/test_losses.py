"""Hand-computed checks of tinkerless.functions.losses.

Shared example: 2 sequences x 3 tokens, the last token of sequence 2 is padding.

    mask       = [[1, 1, 1], [1, 1, 0]]       -> 5 tokens; seq 1 has 3, seq 2 has 2
    ratio r    = [[1.0, 1.5, 0.5], [1.1, 0.7, -]]
    advantage  = [[+1, +1, +1], [-2, -2, -]]
    sampler p  = 0.5 everywhere, so policy p = 0.5 * r:
    logprobs   = [[ln .5, ln .75, ln .25], [ln .55, ln .35, -]]
               = [[-0.693147, -0.287682, -1.386294], [-0.597837, -1.049822, -]]
    clip range = [1 - 0.2, 1 + 0.28] = [0.8, 1.28]
"""

from __future__ import annotations

import math

import pytest
import torch

from tinkerless.errors import ConfigError
from tinkerless.functions.losses import LOSS_NAMES, LossConfig, compute_loss

MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
RATIO = [[1.0, 1.5, 0.5], [1.1, 0.7, 1.0]]  # pad ratio is irrelevant
ADV = [[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]
SAMPLER_P = 0.5


def approx(x: float):
    return pytest.approx(x, abs=1e-5)


def example(dtype=torch.float32):
    """(logprobs with grad, mask, advantages, sampler_logprobs) of the shared example."""
    sampler = torch.full((2, 3), math.log(SAMPLER_P), dtype=torch.float64)
    logprobs = (sampler + torch.tensor(RATIO, dtype=torch.float64).log()).to(dtype).requires_grad_(True)
    return logprobs, torch.tensor(MASK), torch.tensor(ADV), sampler.float()


def run(config: LossConfig, **extra):
    logprobs, mask, adv, sampler = example()
    loss, metrics = compute_loss(config, logprobs, mask, advantages=adv, sampler_logprobs=sampler, **extra)
    loss.backward()
    return loss, metrics, logprobs.grad


def assert_grad(grad: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(grad, torch.tensor(expected), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- importance_sampling


def test_importance_sampling_token_norm_value_grad_metrics():
    # per-token -r*A: seq1 = -1, -1.5, -0.5 (sum -3.0); seq2 = +2.2, +1.4 (sum 3.6)
    # token norm: (-3.0 + 3.6) / 5 = 0.12
    loss, metrics, grad = run(LossConfig(name="importance_sampling"))
    assert loss.item() == approx(0.12)
    # gradient flows through r: d(-r*A)/d logprob = -r*A, divided by 5 tokens
    assert_grad(grad, [[-0.2, -0.3, -0.1], [0.44, 0.28, 0.0]])
    assert metrics["loss"] == approx(0.12)
    assert metrics["tokens"] == 5.0
    assert metrics["ratio_mean"] == approx(0.96)  # (1 + 1.5 + 0.5 + 1.1 + 0.7) / 5
    assert metrics["clip_fraction"] == 0.0  # no clipping in this loss
    assert "kl" not in metrics and "tis_weight_mean" not in metrics
    assert all(type(v) is float for v in metrics.values())


def test_importance_sampling_sequence_norm():
    # mean over sequences of token-means: (-3.0/3 + 3.6/2) / 2 = (-1 + 1.8) / 2 = 0.4
    loss, _, grad = run(LossConfig(name="importance_sampling", normalization="sequence"))
    assert loss.item() == approx(0.4)
    # seq1 tokens weigh 1/(2*3), seq2 tokens 1/(2*2): -r*A/6 and -r*A/4
    assert_grad(grad, [[-1 / 6, -1.5 / 6, -0.5 / 6], [2.2 / 4, 1.4 / 4, 0.0]])


def test_importance_sampling_constant_norm():
    # Dr.GRPO: masked sum / constant = 0.6 / 10 = 0.06
    loss, _, grad = run(LossConfig(name="importance_sampling", normalization="constant", normalization_constant=10.0))
    assert loss.item() == approx(0.06)
    assert_grad(grad, [[-0.1, -0.15, -0.05], [0.22, 0.14, 0.0]])


# ---------------------------------------------------------------- ppo


def test_ppo_value_clipped_tokens_get_zero_grad():
    # A=+1: r=1.0 -> min(1, 1) = 1 -> -1
    #       r=1.5 -> min(1.5, 1.28) = 1.28 -> -1.28  (clipped branch: no gradient)
    #       r=0.5 -> min(0.5, 0.8) = 0.5 -> -0.5     (outside range, but unclipped branch wins)
    # A=-2: r=1.1 -> min(-2.2, -2.2) -> +2.2
    #       r=0.7 -> min(-1.4, -1.6) = -1.6 -> +1.6  (clipped branch: no gradient)
    # sum = -1 - 1.28 - 0.5 + 2.2 + 1.6 = 1.02; token norm 1.02 / 5 = 0.204
    loss, metrics, grad = run(LossConfig(name="ppo"))
    assert loss.item() == approx(0.204)
    assert_grad(grad, [[-0.2, 0.0, -0.1], [0.44, 0.0, 0.0]])
    assert metrics["clip_fraction"] == approx(0.6)  # r in {1.5, 0.5, 0.7} outside [0.8, 1.28]: 3/5
    assert metrics["ratio_mean"] == approx(0.96)


def test_ppo_sequence_norm():
    # seq1 sum -2.78 over 3 tokens, seq2 sum 3.8 over 2: (-2.78/3 + 1.9) / 2 = 2.92 / 6 = 0.486667
    loss, _, _ = run(LossConfig(name="ppo", normalization="sequence"))
    assert loss.item() == approx(2.92 / 6)


def test_ppo_symmetric_clip_changes_upper_bound():
    # clip_high=0.2 -> range [0.8, 1.2]: token r=1.5 now contributes -1.2 instead of -1.28
    # sum = -1 - 1.2 - 0.5 + 2.2 + 1.6 = 1.1; / 5 = 0.22
    loss, _, _ = run(LossConfig(name="ppo", clip_high=0.2))
    assert loss.item() == approx(0.22)


# ---------------------------------------------------------------- cispo


def test_cispo_value_and_weight_has_no_grad():
    # clip(r) = [[1, 1.28, 0.8], [1.1, 0.8]]; per-token -clip(r)*A*logprob:
    # seq1: -1*(-0.693147) = 0.693147; -1.28*(-0.287682) = 0.368233; -0.8*(-1.386294) = 1.109035
    # seq2: 2.2*(-0.597837) = -1.315241; 1.6*(-1.049822) = -1.679715
    # sum = 2.170415 - 2.994956 = -0.824541; token norm / 5 = -0.164908
    loss, metrics, grad = run(LossConfig(name="cispo"))
    assert loss.item() == approx(-0.164908)
    # IS weight is detached: grad = -clip(r)*A / 5 (no d r / d logprob term); every token keeps a gradient
    assert_grad(grad, [[-0.2, -0.256, -0.16], [0.44, 0.32, 0.0]])
    assert metrics["clip_fraction"] == approx(0.6)


def test_cispo_sequence_norm():
    # (2.170415/3 + (-2.994956)/2) / 2 = (0.723472 - 1.497478) / 2 = -0.387003
    loss, _, _ = run(LossConfig(name="cispo", normalization="sequence"))
    assert loss.item() == approx(-0.387003)


# ---------------------------------------------------------------- cross_entropy

CE_LOGPROBS = [[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]]


def run_ce(config: LossConfig, **extra):
    logprobs = torch.tensor(CE_LOGPROBS, requires_grad=True)
    loss, metrics = compute_loss(config, logprobs, torch.tensor(MASK), **extra)
    loss.backward()
    return loss, metrics, logprobs.grad


@pytest.mark.parametrize(
    "normalization, constant, expected",
    [
        ("token", None, 3.0),  # (1+2+3 + 4+5) / 5 = 15 / 5
        ("sequence", None, 3.25),  # (6/3 + 9/2) / 2 = (2 + 4.5) / 2
        ("constant", 10.0, 1.5),  # 15 / 10
    ],
)
def test_cross_entropy_normalizations(normalization, constant, expected):
    config = LossConfig(name="cross_entropy", normalization=normalization, normalization_constant=constant)
    loss, metrics, _ = run_ce(config)
    assert loss.item() == approx(expected)
    assert metrics == {"tokens": 5.0, "loss": approx(expected)}


def test_cross_entropy_grad():
    _, _, grad = run_ce(LossConfig(name="cross_entropy"))
    assert_grad(grad, [[-0.2, -0.2, -0.2], [-0.2, -0.2, 0.0]])


# ---------------------------------------------------------------- TIS

# exp(old - sampler) = [[1.0, 3.0, 0.5], [2.0, 1.5, -]]; cap 2 -> w = [[1, 2, 0.5], [2, 1.5]]
TIS_RAW = [[1.0, 3.0, 0.5], [2.0, 1.5, 1.0]]


def old_logprobs() -> torch.Tensor:
    return (math.log(SAMPLER_P) + torch.tensor(TIS_RAW, dtype=torch.float64).log()).float()


def test_tis_importance_sampling():
    # The policy term's ratio is against old (Yao et al.'s decoupled form): r_old = r / raw
    #   = [[1.0, 0.5, 1.0], [0.55, 0.466667]].
    # per-token -r_old*A*w: seq1 = -1*1, -0.5*2, -1*0.5 = -1, -1, -0.5 (sum -2.5)
    #                       seq2 = 0.55*2*2, 0.466667*2*1.5 = 2.2, 1.4 (sum 3.6); (3.6 - 2.5) / 5 = 0.22
    loss, metrics, grad = run(LossConfig(name="importance_sampling", tis_cap=2.0), old_logprobs=old_logprobs())
    assert loss.item() == approx(0.22)
    assert_grad(grad, [[-0.2, -0.2, -0.1], [0.44, 0.28, 0.0]])  # -r_old*A*w / 5, w is a constant
    assert metrics["tis_weight_mean"] == approx(1.4)  # (1 + 2 + 0.5 + 2 + 1.5) / 5


def test_tis_ppo():
    # clip(r_old) to [0.8, 1.28]: seq1 min(r*A, clip*A) = 1, 0.5, 1 -> per-token -1, -0.5, -1 times w [1, 2, 0.5]
    # = -1, -1, -0.5; seq2 (A = -2) min(-1.1, -1.6), min(-0.933, -1.6) -> 1.6, 1.6 times w [2, 1.5] = 3.2, 2.4
    # sum 3.1; / 5 = 0.62
    loss, _, _ = run(LossConfig(name="ppo", tis_cap=2.0), old_logprobs=old_logprobs())
    assert loss.item() == approx(0.62)


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo"])
def test_tis_caps_every_tokens_weight(name):
    """The update's own log-probs as old (async: the policy k versions after the sampler's): each token's gradient
    is -A * min(pi / mu, C) / N, so a token the sampler found far less likely than the trainer does moves the
    policy by at most the cap, never by pi / mu times the cap."""
    _, _, grad = run(LossConfig(name=name, tis_cap=2.0, old_logprobs_current=True))
    weights = torch.tensor(RATIO).clamp(max=2.0)  # pi / mu per token, capped
    expected = (-torch.tensor(ADV) * weights * torch.tensor(MASK) / 5).tolist()
    assert_grad(grad, expected)


def test_tis_cap_without_old_logprobs_raises():
    with pytest.raises(ConfigError, match="old_logprobs"):
        run(LossConfig(name="ppo", tis_cap=2.0))


# ---------------------------------------------------------------- KL (k3)

# delta = ref - logprobs = [[0, ln2, -ln2], [1, -1, -]]
# k3 = e^d - d - 1 = [[0, 0.306853, 0.193147], [0.718282, 0.367879]]; sum 1.586161, mean 0.317232
KL_DELTA = [[0.0, math.log(2), -math.log(2)], [1.0, -1.0, 0.0]]


def test_kl_cross_entropy_value_grad_metric():
    ref = torch.tensor(CE_LOGPROBS) + torch.tensor(KL_DELTA)
    loss, metrics, grad = run_ce(LossConfig(name="cross_entropy", kl_coef=0.1), ref_logprobs=ref)
    assert loss.item() == approx(3.0 + 0.1 * 0.317232)  # 3.031723
    assert metrics["kl"] == approx(0.317232)
    # d/dlp [-lp + 0.1*k3] = -1 + 0.1*(1 - e^d), / 5:
    # d=0: -0.2; ln2: -1.1/5 = -0.22; -ln2: -0.95/5 = -0.19; 1: -1.171828/5; -1: -0.936788/5
    assert_grad(grad, [[-0.2, -0.22, -0.19], [-0.234366, -0.187358, 0.0]])


def test_kl_with_rl_loss_is_not_tis_weighted():
    # IS + TIS = 0.22 (above); KL term added unweighted: 0.22 + 0.1 * 0.317232 = 0.251723
    logprobs, *_ = example()
    ref = logprobs.detach() + torch.tensor(KL_DELTA)
    loss, metrics, _ = run(
        LossConfig(name="importance_sampling", tis_cap=2.0, kl_coef=0.1),
        old_logprobs=old_logprobs(),
        ref_logprobs=ref,
    )
    assert loss.item() == approx(0.251723)
    assert metrics["kl"] == approx(0.317232)


def test_kl_without_ref_raises():
    with pytest.raises(ConfigError, match="ref_logprobs"):
        run_ce(LossConfig(name="cross_entropy", kl_coef=0.1))


# ---------------------------------------------------------------- masks and padding


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("normalization", ["token", "sequence", "constant"])
def test_all_zero_mask_is_zero_not_nan(name, normalization):
    logprobs, _, adv, sampler = example()
    config = LossConfig(name=name, normalization=normalization, normalization_constant=4.0)
    loss, metrics = compute_loss(config, logprobs, torch.zeros(2, 3), advantages=adv, sampler_logprobs=sampler)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logprobs.grad, torch.zeros(2, 3))
    assert metrics["tokens"] == 0.0 and not any(math.isnan(v) for v in metrics.values())


def test_sequence_norm_skips_empty_sequences():
    # only seq1 has tokens: -3.0 / 3 = -1.0 (an empty seq2 must not halve it)
    logprobs, _, adv, sampler = example()
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    loss, _ = compute_loss(
        LossConfig(normalization="sequence"), logprobs, mask, advantages=adv, sampler_logprobs=sampler
    )
    assert loss.item() == approx(-1.0)


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo"])
def test_garbage_in_padding_does_not_leak(name):
    clean_loss, _, clean_grad = run(LossConfig(name=name))
    logprobs, mask, adv, sampler = example()
    with torch.no_grad():
        logprobs[1, 2] = float("nan")
    sampler[1, 2] = float("-inf")
    adv[1, 2] = float("nan")
    loss, _ = compute_loss(LossConfig(name=name), logprobs, mask, advantages=adv, sampler_logprobs=sampler)
    loss.backward()
    assert loss.item() == approx(clean_loss.item())
    torch.testing.assert_close(logprobs.grad, clean_grad)


def test_bf16_logprobs_compute_in_fp32_and_get_grad():
    logprobs, mask, adv, sampler = example(torch.bfloat16)
    loss, _ = compute_loss(LossConfig(), logprobs, mask, advantages=adv, sampler_logprobs=sampler)
    loss.backward()
    assert loss.dtype == torch.float32
    assert logprobs.grad is not None and logprobs.grad.dtype == torch.bfloat16
    assert loss.item() == pytest.approx(0.12, abs=2e-2)  # bf16 rounding of the inputs only


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "config, field",
    [
        (LossConfig(name="reinforce"), "name"),
        (LossConfig(normalization="batch"), "normalization"),
        (LossConfig(normalization="constant"), "normalization_constant"),
        (LossConfig(normalization="constant", normalization_constant=0.0), "normalization_constant"),
        (LossConfig(clip_low=1.5), "clip_low"),
        (LossConfig(clip_high=-0.1), "clip_high"),
        (LossConfig(tis_cap=0.0), "tis_cap"),
        (LossConfig(kl_coef=-1.0), "kl_coef"),
    ],
)
def test_validate_names_the_bad_field(config, field):
    with pytest.raises(ConfigError, match=field) as info:
        config.validate()
    assert info.value.hint


def test_default_config_is_valid():
    LossConfig().validate()


@pytest.mark.parametrize("missing", ["advantages", "sampler_logprobs"])
def test_rl_loss_missing_inputs_raise(missing):
    logprobs, mask, adv, sampler = example()
    inputs = {"advantages": adv, "sampler_logprobs": sampler}
    inputs[missing] = None
    with pytest.raises(ConfigError, match=missing):
        compute_loss(LossConfig(name="ppo"), logprobs, mask, **inputs)


def test_shape_mismatch_raises():
    logprobs, mask, adv, sampler = example()
    with pytest.raises(ConfigError, match="advantages has shape"):
        compute_loss(LossConfig(), logprobs, mask, advantages=adv[:, :2], sampler_logprobs=sampler)
    with pytest.raises(ConfigError, match=r"\[B, T\]"):
        compute_loss(LossConfig(name="cross_entropy"), logprobs.reshape(-1), mask.reshape(-1))


def test_weighted_cross_entropy_is_a_weighted_sum():
    # Tinker's cross_entropy: -sum(w * logp), weights any real number (negative ones push logp down).
    # logp = -[1, 2, 3], -[4, 5, _]; w = [2, 0, -1], [1, 0.5, 9 (masked)]
    # loss = 2*1 + 0 - 3 + 4 + 2.5 = 5.5 ; d loss / d logp = -w on masked-in tokens
    logprobs = -torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    weights = torch.tensor([[2.0, 0.0, -1.0], [1.0, 0.5, 9.0]])
    config = LossConfig(name="cross_entropy", normalization="constant", normalization_constant=1.0)
    leaf = logprobs.detach().requires_grad_(True)
    loss, _ = compute_loss(config, leaf, torch.tensor(MASK), advantages=weights)
    loss.backward()
    assert loss.item() == approx(5.5)
    assert leaf.grad.tolist() == [[-2.0, 0.0, 1.0], [-1.0, -0.5, 0.0]]
