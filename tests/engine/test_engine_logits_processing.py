"""vLLM's sampling extras against reference computations on the model's own logits.

References: transformers' LogitsProcessors where they exist (repetition penalty, sequence bias,
min new tokens, temperature + min-p), NumPy for OpenAI's presence/frequency penalties and for
log-softmax, all fed with HF's logits of the same checkpoint (float32, equal to ours to 2e-4).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import HFCheckpoint, random_prompts

from engine import LLM, SamplingParams
from engine.logits_processor import LogitsProcessor
from engine.sequence import Sequence
from kernels import make_ops
from kernels.reference import sampling_probs

torch = pytest.importorskip("torch")
generation = pytest.importorskip("transformers.generation.logits_process")

NUM_NEW = 10


@pytest.fixture(scope="module")
def llm(qwen3: HFCheckpoint):
    with LLM(str(qwen3.path), device="cpu") as llm:
        yield llm


def reference_greedy(ckpt: HFCheckpoint, prompt: list[int], num_new: int, adjust) -> list[int]:
    """Greedy decoding of HF logits, ``adjust(ids, logits_row) -> logits_row`` each step."""
    ids = list(prompt)
    for _ in range(num_new):
        row = adjust(ids, ckpt.logits(ids)[-1].astype(np.float32))
        ids.append(int(np.argmax(row)))
    return ids[len(prompt):]


def hf_processor(processor):
    def adjust(ids: list[int], row: np.ndarray) -> np.ndarray:
        return processor(torch.tensor([ids]), torch.tensor(row[None]))[0].numpy()
    return adjust


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, **kw)


def test_repetition_penalty_matches_transformers(llm: LLM, qwen3: HFCheckpoint) -> None:
    prompts = random_prompts(4000, [6, 19], seed=21)
    for penalty in (1.8, 0.6):
        outs = llm.generate(prompts, greedy(repetition_penalty=penalty))
        plain = llm.generate(prompts, greedy())
        proc = hf_processor(generation.RepetitionPenaltyLogitsProcessor(penalty))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == reference_greedy(qwen3, prompt, NUM_NEW, proc)
        assert [o.token_ids for o in outs] != [o.token_ids for o in plain]


def test_presence_and_frequency_penalties_match_numpy(llm: LLM, qwen3: HFCheckpoint) -> None:
    prompt = random_prompts(4000, [11], seed=22)[0]
    for presence, frequency in ((1.5, 0.0), (0.0, 2.0), (-2.0, 0.7)):
        def adjust(ids: list[int], row: np.ndarray, presence: float = presence,
                   frequency: float = frequency) -> np.ndarray:
            counts = np.bincount(ids[len(prompt):], minlength=row.size).astype(np.float32)
            return row - frequency * counts - presence * (counts > 0)
        out = llm.generate([prompt], greedy(presence_penalty=presence,
                                            frequency_penalty=frequency))[0]
        assert out.token_ids == reference_greedy(qwen3, prompt, NUM_NEW, adjust)


def test_logit_bias_matches_transformers_sequence_bias(llm: LLM, qwen3: HFCheckpoint) -> None:
    prompt = random_prompts(4000, [9], seed=23)[0]
    plain = llm.generate([prompt], greedy())[0].token_ids
    bias = {plain[0]: -100.0, plain[2]: -3.5, 777: 2.5}
    out = llm.generate([prompt], greedy(logit_bias=bias))[0]
    proc = generation.SequenceBiasLogitsProcessor({(k,): v for k, v in bias.items()})
    assert out.token_ids == reference_greedy(qwen3, prompt, NUM_NEW, hf_processor(proc))
    assert out.token_ids[0] != plain[0]


def test_min_tokens_matches_transformers_min_new_tokens(qwen3: HFCheckpoint, tmp_path: Path
                                                        ) -> None:
    folder = shutil.copytree(qwen3.path, tmp_path / "m")
    prompt = random_prompts(4000, [8], seed=24)[0]
    with LLM(str(folder), device="cpu") as llm:
        plain = llm.generate([prompt], greedy())[0].token_ids
    eos = plain[1]  # the second greedy token becomes an eos token
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    with LLM(str(folder), device="cpu") as llm:
        assert llm.generate([prompt], SamplingParams(max_tokens=NUM_NEW))[0].token_ids == \
            plain[:2]
        out = llm.generate([prompt], SamplingParams(max_tokens=NUM_NEW, min_tokens=5))[0]
    proc = generation.MinNewTokensLengthLogitsProcessor(len(prompt), 5, eos)
    reference = reference_greedy(qwen3, prompt, NUM_NEW, hf_processor(proc))
    # ours stops at the first eos after the minimum, the reference decodes on: compare the prefix
    assert len(out.token_ids) > 5 and eos not in out.token_ids[:5]
    assert out.token_ids == reference[: len(out.token_ids)]
    assert out.finish_reason == "length" or out.token_ids[-1] == eos


def test_stop_token_ids_end_generation_and_hide_the_token(llm: LLM) -> None:
    prompt = random_prompts(4000, [7], seed=25)[0]
    plain = llm.generate([prompt], greedy())[0]
    stop_id = plain.token_ids[3]
    cut = plain.token_ids.index(stop_id) + 1
    out = llm.generate([prompt], greedy(stop_token_ids=[stop_id, 5]))[0]
    assert out.token_ids == plain.token_ids[:cut] and out.finish_reason == "stop"
    # (an incomplete UTF-8 character at the end stays held back, as before an eos)
    assert out.text == llm.tokenizer.decode(plain.token_ids[: cut - 1]).rstrip("\ufffd")
    shown = llm.generate([prompt], greedy(stop_token_ids=[stop_id],
                                          include_stop_str_in_output=True))[0]
    assert shown.text == llm.tokenizer.decode(plain.token_ids[:cut])
    # min_tokens masks the stop token while fewer tokens were generated: the cut-th differs
    held = llm.generate([prompt], greedy(stop_token_ids=[stop_id], min_tokens=cut))[0]
    assert held.token_ids[: cut - 1] == plain.token_ids[: cut - 1]
    assert held.token_ids[cut - 1] != stop_id and len(held.token_ids) >= cut


def test_include_stop_str_in_output_keeps_the_stop_string(llm: LLM) -> None:
    prompt = random_prompts(4000, [7], seed=26)[0]
    text = llm.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0].text
    stop = text[10:13]
    cut = text.find(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop],
                                                include_stop_str_in_output=True))[0]
    assert out.finish_reason == "stop" and out.text == text[: cut + len(stop)]


def test_skip_special_tokens_false_keeps_their_text(llm: LLM) -> None:
    prompt = random_prompts(4000, [5], seed=27)[0]
    start_id = llm.tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]
    params = dict(max_tokens=3, ignore_eos=True, logit_bias={start_id: 100.0})
    hidden = llm.generate([prompt], SamplingParams(**params))[0]
    shown = llm.generate([prompt], SamplingParams(**params, skip_special_tokens=False))[0]
    assert hidden.token_ids == shown.token_ids == [start_id] * 3
    assert hidden.text == "" and shown.text == "<|im_start|>" * 3


def test_logprobs_are_the_log_softmax_of_the_model_logits(llm: LLM, qwen3: HFCheckpoint
                                                          ) -> None:
    prompt = random_prompts(4000, [12], seed=28)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5,
                                                temperature=0.8, seed=3,
                                                repetition_penalty=1.3))[0]
    assert [e.token_id for e in out.logprobs] == out.token_ids
    for k, entry in enumerate(out.logprobs):
        logits = qwen3.logits(prompt + out.token_ids[:k])[-1].astype(np.float64)
        reference = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        assert entry.logprob == pytest.approx(reference[entry.token_id], abs=1e-3)
        top_ids = [i for i, _ in entry.top]
        assert top_ids == np.argsort(-reference, kind="stable")[:5].tolist()
        np.testing.assert_allclose([lp for _, lp in entry.top], reference[top_ids], atol=1e-3)
    none = llm.generate([prompt], greedy())[0]
    zero = llm.generate([prompt], greedy(logprobs=0))[0]
    assert none.logprobs is None and all(e.top == () for e in zero.logprobs)
    assert zero.token_ids == none.token_ids


def _seq(params: SamplingParams, token_ids: list[int]) -> Sequence:
    return Sequence(request_id="r", prompt_token_ids=token_ids, params=params,
                    namespace_digest=b"", generator=np.random.default_rng(0), detokenizer=None)


@pytest.mark.parametrize("temperature, min_p", [(1.0, 0.1), (0.7, 0.05), (1.6, 0.3), (1.0, 1.0)])
def test_min_p_matches_transformers_warpers(temperature: float, min_p: float) -> None:
    logits = np.random.default_rng(29).normal(0, 3, (3, 500)).astype(np.float32)
    params = SamplingParams(temperature=temperature, min_p=min_p)
    processed = LogitsProcessor(make_ops("cpu"), [0])(logits, [_seq(params, [1, 2])] * 3)
    ours = sampling_probs(processed, np.full(3, temperature, np.float32),
                          np.zeros(3, np.int32), np.ones(3, np.float32))
    scores = generation.TemperatureLogitsWarper(temperature)(None, torch.tensor(logits))
    scores = generation.MinPLogitsWarper(min_p)(None, scores)
    reference = torch.softmax(scores, dim=-1).numpy()
    np.testing.assert_allclose(ours, reference, atol=1e-6)
    assert ((ours == 0) == (reference == 0)).all() and (ours == 0).any()


def test_min_p_one_samples_the_greedy_token(llm: LLM) -> None:
    prompts = random_prompts(4000, [5, 13], seed=30)
    plain = llm.generate(prompts, greedy())
    sampled = llm.generate(prompts, greedy(temperature=1.5, min_p=1.0))
    assert [o.token_ids for o in sampled] == [o.token_ids for o in plain]


def test_rows_are_adjusted_independently_in_a_batch(llm: LLM) -> None:
    p, q = random_prompts(4000, [9, 16], seed=31)
    penalized = greedy(repetition_penalty=1.7, logit_bias={10: 4.0}, logprobs=2)
    sampled = greedy(temperature=0.9, seed=4, min_p=0.05, frequency_penalty=0.5)
    alone = [llm.generate([p], greedy())[0], llm.generate([q], penalized)[0],
             llm.generate([p], sampled)[0]]
    batch = llm.generate([p, q, p], [greedy(), penalized, sampled])
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone]
    for got, want in zip(batch[1].logprobs, alone[1].logprobs, strict=True):  # batched GEMMs
        assert [i for i, _ in got.top] == [i for i, _ in want.top]  # round a little differently
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


@pytest.mark.parametrize("kwargs, message", [
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),
    ({"repetition_penalty": 1e4}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 20, "max_tokens": 10}, "exceed"),
    ({"logit_bias": {5: 101}}, "logit_bias"), ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"), ({"skip_special_tokens": 1}, "skip_special_tokens"),
])
def test_bad_values_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_token_ids_beyond_the_vocabulary_are_refused(llm: LLM) -> None:
    vocab = llm.engine.vocab_size
    for params in (SamplingParams(stop_token_ids=[vocab]), SamplingParams(logit_bias={vocab: 1})):
        with pytest.raises(ValueError, match="out of range"):
            llm.engine.add_request("bad", [5, 6], params)


@pytest.mark.gpu
def test_cuda_backend_adjusts_logits_as_numpy_does() -> None:
    """The same adjustments through CuPy: equal logits, equal sampling probabilities, and the
    logprobs of the raw logits."""
    from engine.sampler import Sampler

    logits = np.random.default_rng(32).normal(0, 3, (4, 300)).astype(np.float32)
    params = [SamplingParams(temperature=0.8, min_p=0.1, repetition_penalty=1.4, min_tokens=5,
                             logit_bias={3: 5.0, 7: -100.0}, stop_token_ids=[9], logprobs=3),
              SamplingParams(presence_penalty=1.0, frequency_penalty=-0.5),
              SamplingParams(temperature=1.2, top_k=20, top_p=0.9),
              SamplingParams()]
    seqs = [_seq(p, [1, 2, 3, 3, 5]) for p in params]
    for seq in seqs:
        seq.token_ids += [5, 5, 8]
    cpu, gpu = make_ops("cpu"), make_ops("cuda")
    want = LogitsProcessor(cpu, [0])(logits, seqs)
    got = gpu.to_host(LogitsProcessor(gpu, [0])(gpu.to_device(logits), seqs))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert (np.isneginf(got) == np.isneginf(want)).all()
    temps, ks, ps = (np.array([1, 1, 1.2, 1], np.float32), np.array([0, 0, 20, 0], np.int32),
                     np.array([1, 1, 0.9, 1], np.float32))
    np.testing.assert_allclose(gpu.to_host(gpu.sampling_probs(gpu.to_device(want), *map(
        gpu.to_device, (temps, ks, ps)))), cpu.sampling_probs(want, temps, ks, ps), atol=1e-6)
    [(token, entry), *_] = Sampler(gpu, [0])(gpu.to_device(logits), seqs)
    raw = logits[0].astype(np.float64)
    log_softmax = raw - raw.max() - np.log(np.exp(raw - raw.max()).sum())
    assert token not in (7, 9) and entry.token_id == token  # bias -100; min_tokens bans 9
    assert entry.logprob == pytest.approx(log_softmax[token], abs=1e-5)
    assert [i for i, _ in entry.top] == np.argsort(-log_softmax, kind="stable")[:3].tolist()
