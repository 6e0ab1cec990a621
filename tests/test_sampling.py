"""Position-keyed sampling: deterministic per (seed, position), an exact sample of the processed
target distribution, and independent of batching."""

from __future__ import annotations

import pytest
import torch

from splitspec.runtime.sampling import _fmix32, keyed_gumbel, process_logits, sample
from splitspec.runtime.sampling_params import SamplingParams


def test_noise_is_keyed_by_seed_and_position():
    seeds = torch.tensor([7, 7, 8, 7])
    positions = torch.tensor([0, 1, 0, 0])
    noise = keyed_gumbel(seeds, positions, 50)
    assert torch.equal(noise[0], noise[3])  # same (seed, position): same noise
    assert not torch.allclose(noise[0], noise[1]) and not torch.allclose(noise[0], noise[2])
    assert torch.equal(noise[0], keyed_gumbel(torch.tensor([7]), torch.tensor([0]), 50)[0])
    big = keyed_gumbel(torch.tensor([2**62 + 5]), torch.tensor([10**9]), 8)
    assert torch.isfinite(big).all()


def test_noise_is_finite_at_the_extremes_and_over_a_real_vocabulary():
    """All-ones and all-zero hash bits must not give uniforms of exactly 0 or 1 (infinite noise)."""
    import splitspec.runtime.sampling as sampling

    for bits in (0, 0xFFFFFFFF):
        uniform = ((torch.tensor([bits]) >> (32 - sampling.UNIFORM_BITS)).float() + 0.5) / 2**sampling.UNIFORM_BITS
        assert 0 < uniform.item() < 1
    # Llama-3's vocabulary over many positions: ~2.6e7 draws, where 2^-24-probability edge cases occur
    noise = keyed_gumbel(torch.full((200,), 1234), torch.arange(200), 128256)
    assert torch.isfinite(noise).all() and noise.max() < 17 and noise.min() > -3
    # fmix32 is a bijection of uint32, so every bit pattern, the all-ones one included, occurs
    sample_bits = _fmix32(torch.arange(2**16))
    assert sample_bits.unique().numel() == 2**16


def test_filtered_tokens_are_never_sampled_with_a_huge_vocabulary():
    logits = torch.zeros(1, 128256)
    logits[0, :5] = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.1])
    params = [SamplingParams(temperature=1.0, top_k=5, seed=1234)] * 300
    tokens = sample(logits.expand(300, -1).clone(), params, list(range(300)))
    assert tokens.max() < 5


def test_noise_is_gumbel():
    noise = keyed_gumbel(torch.full((400,), 3), torch.arange(400), 500).flatten()  # 200k draws
    euler_gamma = 0.5772156649
    assert abs(noise.mean().item() - euler_gamma) < 0.01
    assert abs(noise.var().item() - torch.pi**2 / 6) < 0.03


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return (((counts - expected) ** 2)[keep] / expected[keep]).sum().item()


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.3, 3, 1.0), (1.0, -1, 0.8), (0.9, 4, 0.7)],
)
def test_samples_follow_the_processed_distribution(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0])
    num = 40000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=1234)] * num
    tokens = sample(logits.expand(num, -1).clone(), params, list(range(num)))
    counts = torch.bincount(tokens, minlength=len(logits)).float()
    processed = process_logits(logits[None], torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))[0]
    probs = processed.softmax(-1)
    assert counts[probs == 0].sum() == 0  # filtered tokens never drawn
    dof = int((probs > 0).sum()) - 1
    # 99.9% quantile of chi-square is below dof + 6*sqrt(2*dof) + 10 for these dof
    assert chi_square(counts, probs) < dof + 6 * (2 * dof) ** 0.5 + 10


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    one = torch.ones(1)

    def kept(top_k=-1, top_p=1.0):
        out = process_logits(logits, one, torch.tensor([top_k]), torch.tensor([top_p]))
        return torch.isfinite(out[0]).nonzero().flatten().tolist()

    # SGLang's rule: drop a token when the mass ranked strictly before it exceeds top_p, measured on
    # the distribution before top-k (probs 0.5, 0.3, 0.15, 0.05; mass before: 0, 0.5, 0.8, 0.95)
    assert kept() == [0, 1, 2, 3]
    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.7) == [0, 1]
    assert kept(top_p=0.9) == [0, 1, 2]
    assert kept(top_p=0.01) == [0]
    assert kept(top_k=3, top_p=0.6) == [0, 1]  # vLLM would renormalise after top-k first and keep [0]
    assert kept(top_k=1, top_p=1.0) == [0]


def test_sampling_is_batch_invariant_and_greedy_rows_are_argmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 100)
    params = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2),
        SamplingParams(temperature=1.0, top_k=1, seed=3),
        SamplingParams(temperature=1.2, top_k=10, seed=4),
    ]
    positions = [3, 0, 7, 2, 9]
    together = sample(logits.clone(), params, positions)
    alone = [sample(logits[i : i + 1].clone(), [params[i]], [positions[i]]).item() for i in range(5)]
    assert together.tolist() == alone
    assert together[1] == logits[1].argmax() and together[3] == logits[3].argmax()


def test_invalid_params_are_refused():
    assert SamplingParams(temperature=1e-7).is_greedy and not SamplingParams(temperature=1e-5).is_greedy
    for kwargs in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=0), dict(seed=-3)):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)
    assert SamplingParams(temperature=1.0).with_seed().seed is not None
    with pytest.raises(ValueError, match="needs a seed"):
        sample(torch.zeros(1, 4), [SamplingParams(temperature=1.0)], [0])


def test_the_engines_own_kernel_calls_run_outside_autograd(monkeypatch):
    """The engine's step samples and accepts with kernels of its own (kernels.ops: keyed Gumbel-max here), which a GPU
    runs as Triton kernels only outside autograd: the step runs with it off (the engine's thread had it on, so a GPU
    ran their torch twins)."""
    from splitspec.demo import demo_model_dirs
    from splitspec.generate import generate_ids
    from splitspec.kernels import ops
    from splitspec.runtime.runner import ModelRunner, RuntimeConfig

    seen = []
    original = ops.use_triton

    def recording(x, *args, **kwargs):
        seen.append(torch.is_grad_enabled())
        return original(x, *args, **kwargs)

    monkeypatch.setattr(ops, "use_triton", recording)
    runner = ModelRunner.load(RuntimeConfig(model_path=str(demo_model_dirs()["target"]), dtype="float32", device="cpu",
                                            max_total_tokens=1024))
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_new_tokens=4, ignore_eos=True)
    seen.clear()  # what the loading ran
    assert torch.is_grad_enabled()  # as in a thread of its own
    out = generate_ids(runner, [[5, 6, 7, 8]], [params], set())
    assert len(out[0].output_ids) == 4
    assert seen and not any(seen), seen
