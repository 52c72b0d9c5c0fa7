"""pdserve eval (engine.evaluation): corpus, metrics, the engine's scoring, the command."""
import json
import math

import pytest
import torch

from engine.evaluation import metrics
from engine.evaluation.corpus import Corpus, Document, file_corpus, load_corpus, stdlib_corpus
from engine.evaluation.run import EvalSettings, pick_windows


def test_stdlib_corpus_is_stable_and_split_by_title():
    a, b = stdlib_corpus(), stdlib_corpus()
    assert a.sha256 == b.sha256 and len(a.documents) > 100
    parts = a.describe()["parts"]
    assert parts["tune"] > 50 and parts["heldout"] > 50
    tune, held = a.part("tune"), a.part("heldout")
    assert tune and held and tune[:200] not in held
    assert Document("x", "t").part == Document("x", "other text").part  # by title only
    with pytest.raises(ValueError, match="expected"):
        load_corpus(None, "0" * 64)


def test_file_corpus(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("first paragraph\n\nsecond one\n\n\n")
    c = file_corpus(str(p))
    assert [d.text for d in c.documents] == ["first paragraph", "second one"]
    assert load_corpus(str(p), c.sha256).sha256 == c.sha256
    (tmp_path / "e.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no text"):
        file_corpus(str(tmp_path / "e.txt"))


def test_metrics_exact_values():
    base = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))
    cand = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.1, 0.8, 0.1]]))
    s = metrics.token_stats(base, cand, torch.tensor([0, 1]))
    kl0 = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    assert torch.allclose(s["kl"], torch.tensor([kl0, 0.0]), atol=1e-6)
    assert s["top1"].tolist() == [0.0, 1.0]
    out = metrics.summarize([s])
    assert out["top1_agreement"] == 0.5 and out["tokens"] == 2
    assert out["perplexity_base"] == pytest.approx(math.exp((math.log(2) - math.log(0.8)) / 2))
    assert metrics.prefix_agreement([1, 2, 3], [1, 2, 4]) == 2
    c = metrics.continuation_stats([[1, 2], [3, 4]], [[1, 2], [3, 5]])
    assert c["per_prompt"] == [2, 1] and c["identical"] == 1
    assert c["mean_tokens_before_divergence"] == 1.5


def test_pick_windows_evenly_spaced():
    ids = list(range(100))
    w = pick_windows(ids, 9, 3)  # 10 windows of 10 tokens; take 0, 3, 6
    assert [x[0] for x in w] == [0, 30, 60] and all(len(x) == 10 for x in w)
    with pytest.raises(ValueError, match="holds 10 windows"):
        pick_windows(ids, 9, 11)
    with pytest.raises(ValueError):
        EvalSettings(window=8, prompt_tokens=8)


def test_engine_score_matches_its_own_greedy_and_logprobs():
    """score() runs the real model, cache and backend: chunked (max_num_batched_tokens 16)
    it gives the same next-token distribution as the engine's own sampling."""
    from engine import LLM, SamplingParams
    llm = LLM("dummy:tiny", num_blocks=64, max_num_batched_tokens=16)
    ids = [(7 * i) % 200 + 3 for i in range(40)]
    lp = llm.engine.score(ids)
    assert lp.shape == (40, llm.engine.model_config.vocab_size)
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=True,
                                             ignore_eos=True))[0]
    assert out.token_ids[0] == int(lp[-1].argmax())
    assert out.logprobs[0] == pytest.approx(lp[-1, out.token_ids[0]].item(), abs=1e-4)
    prefix = llm.engine.score(ids[:20])
    assert torch.allclose(prefix, lp[:20], atol=1e-4)
    assert llm.engine.block_manager.num_free_blocks == 64  # nothing kept
    with pytest.raises(ValueError, match="takes 1 to"):
        llm.engine.score([])


def test_pdserve_eval_command(tmp_path, capsys):
    from pdserve.eval_cli import main
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy "
                                  f"dog number {i}." for i in range(60)))
    out = tmp_path / "r.json"
    rc = main(["--model", "dummy:tiny", "--base", "num_blocks=64", "--corpus", str(corpus),
               "--part", "all", "--window", "32", "--windows", "3", "--continuations", "2",
               "--prompt-tokens", "8", "--new-tokens", "4",
               "--candidate", "same=num_blocks=64",
               "--candidate", "int8=num_blocks=64,quantization=int8", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    same, q = doc["candidates"]["same"], doc["candidates"]["int8"]
    assert doc["benchmark"] == "eval"
    assert doc["corpus"]["sha256"] == file_corpus(str(corpus)).sha256
    assert same["kl_mean"] == 0.0 and same["top1_agreement"] == 1.0
    assert same["greedy"]["identical"] == 2 and same["perplexity"] == same["perplexity_base"]
    assert q["kl_mean"] > 0 and q["weight_bytes"] < same["weight_bytes"]
    assert q["config"].items() >= {"num_blocks": 64, "quantization": "int8",
                                   "model": "dummy:tiny"}.items()
    assert "int8" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--candidate", "quantisation=int8"])
