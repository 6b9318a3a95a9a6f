"""Reading shards: packing, exact resume, rank sharding, mixtures, curriculum, training on them."""

import json

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from conftest import tiny_job
from kiln.data.loader import ShardLoader
from kiln.data.pipeline import build_data
from kiln.data.prepare import PrepareOptions, prepare_texts
from kiln.data.sampler import Sampler, Stage, permute
from kiln.data.shards import PackedSamples, ShardSet
from kiln.data.tokenizer import describe, save_tokenizer, train_bpe
from kiln.errors import KilnError
from kiln.train.trainer import train

WORDS = {"web": "the of and to in is was for on that with".split(),
         "code": "def return self if else for in import class none".split(),
         "math": "sum integral proof lemma theorem let then equals".split()}


def texts(kind, n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS[kind], rng.integers(5, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Three prepared sources (web, code, math), each with a val split, sharing one tokenizer."""
    root = tmp_path_factory.mktemp("prepared")
    tok = describe(train_bpe([t for k in WORDS for t in texts(k, 100)], 300))
    save_tokenizer(tok, root / "tokenizer")
    for i, kind in enumerate(WORDS):
        docs = texts(kind, 300, seed=i + 1)
        prepare_texts(docs, kind, tok, root / kind,
                      PrepareOptions(progress=False, workers=1, shard_tokens=1000, val_fraction=0.1))
    return root, tok


def loader_for(root, names, batch=4, seq_len=16, rank=0, world=1, stages=None, prefetch=2, seed=0):
    samples = [PackedSamples(ShardSet(root / n), seq_len) for n in names]
    stages = stages or [Stage(2**62, np.ones(len(names)) / len(names))]
    sampler = Sampler([len(s) for s in samples], stages, seed, batch, rank, world)
    return ShardLoader(samples, names, sampler, prefetch=prefetch)


def test_packed_samples_cover_the_stream_with_shifted_targets(prepared):
    root, _ = prepared
    shards = ShardSet(root / "web")
    samples = PackedSamples(shards, 16)
    stream = shards.read(0, shards.total_tokens)
    assert len(samples) == (shards.total_tokens - 1) // 16 and len(shards.shards) > 3
    for i in (0, 7, len(samples) - 1):  # some of these windows run across shard boundaries
        np.testing.assert_array_equal(samples.sample(i), stream[i * 16: i * 16 + 17])


def test_resume_after_n_steps_gives_the_same_batches_as_an_uninterrupted_run(prepared):
    root, _ = prepared
    straight = loader_for(root, ["web", "code"])
    expected = [next(straight) for _ in range(12)]
    first = loader_for(root, ["web", "code"])
    head = [next(first) for _ in range(6)]
    state = json.loads(json.dumps(first.state_dict()))  # read-ahead batches are not counted
    first.close()
    resumed = loader_for(root, ["web", "code"])
    resumed.load_state_dict(state)
    got = head + [next(resumed) for _ in range(6)]
    for (ex, ey), (gx, gy) in zip([(b.tokens, b.labels) for b in expected], [(b.tokens, b.labels) for b in got]):
        assert torch.equal(ex, gx) and torch.equal(ey, gy)
    assert not torch.equal(expected[0].tokens, expected[6].tokens)
    resumed.close()
    straight.close()


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_never_share_a_sample_and_together_cover_every_epoch(world):
    n, batch = 203, 5
    samplers = [Sampler([n], [Stage(2**62, np.ones(1))], 3, batch, r, world) for r in range(world)]
    seen = []
    for _ in range(2 * -(-n // (world * batch))):  # a bit over two epochs
        seen.append([[i for _, i in s.next_batch()[0]] for s in samplers])
    flat = [i for step in seen for rank in step for i in rank]
    assert sorted(flat[:n]) == list(range(n))  # epoch 0, exactly once each
    assert sorted(flat[n:2 * n]) == list(range(n))  # epoch 1, a different order
    assert flat[:n] != flat[n:2 * n]
    first_step = seen[0]  # each rank reads its own slice of every global batch
    assert all(len(r) == batch for r in first_step)
    assert len({i for r in first_step for i in r}) == world * batch


def test_permutation_is_a_bijection_that_depends_on_seed_and_epoch():
    for n in (1, 2, 17, 1000, 4097):
        p = permute(np.arange(n), n, seed=1, stream=0, epoch=0)
        assert sorted(p.tolist()) == list(range(n))
    a, b, c = (permute(np.arange(500), 500, s, 0, e).tolist() for s, e in ((1, 0), (1, 1), (2, 0)))
    assert a != b and a != c


def test_mixture_proportions_are_within_one_percent_over_10k_samples(prepared):
    root, _ = prepared
    weights = np.array([0.7, 0.2, 0.1])
    loader = loader_for(root, list(WORDS), batch=50, stages=[Stage(2**62, weights)], prefetch=0)
    for _ in range(200):
        next(loader)
    tokens = loader.tokens_by_source()
    total = sum(tokens.values())
    assert total == 10_000 * 16
    for name, w in zip(WORDS, weights):
        assert abs(tokens[name] / total - w) < 0.01, (name, tokens)


def test_curriculum_switches_mixture_and_sequence_length_at_the_right_step(prepared, tmp_path):
    root, _ = prepared
    sources = [dict(name=k, path=str(root / k)) for k in ("web", "code")]
    cfg = tiny_job(tmp_path, data=dict(
        source="shards", seq_len=16, tokenizer=str(root / "tokenizer"), sources=sources,
        val=[dict(name="web", path=str(root / "web"))], prefetch=0, max_bytes=None,
        curriculum=[dict(until=0.25, seq_len=8, weights={"web": 1.0}),
                    dict(until=0.8, weights={"web": 1.0}),
                    dict(until=1.0, weights={"code": 1.0})]),
        train=dict(micro_batch_size=4, max_steps=20, grad_accum_steps=2))
    data = build_data(cfg, tmp_path / "run", rank=1, world_size=2)
    web_ids = set(ShardSet(root / "web").read(0, ShardSet(root / "web").total_tokens).tolist())
    code_ids = set(ShardSet(root / "code").read(0, ShardSet(root / "code").total_tokens).tolist())
    shapes, kinds = [], []
    for step in range(20):
        for _ in range(2):  # micro-batches of one step
            x = next(data.train).tokens
            shapes.append(tuple(x.shape))
        kinds.append("code" if set(x.flatten().tolist()) - web_ids else "web")
    assert shapes[:10] == [(8, 8)] * 10 and shapes[10:] == [(4, 16)] * 30  # step 5 = 25% of 20
    assert kinds == ["web"] * 16 + ["code"] * 4  # step 16 = 80% of 20
    assert code_ids - web_ids  # the vocabularies differ, so the check above can tell them apart


def test_difficulty_order_reads_documents_easiest_first(prepared, tmp_path):
    root, tok = prepared
    docs = ["theorem " * 3, "lemma " * 3, "proof " * 3]
    options = PrepareOptions(progress=False, workers=1, score_field="score")
    from kiln.data.prepare import prepare

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": d, "score": s}) + "\n"
                            for d, s in zip(docs, (3.0, 1.0, 2.0))))
    prepare([str(path)], tok, tmp_path / "ordered", options)
    samples = PackedSamples(ShardSet(tmp_path / "ordered"), 4, order="difficulty")
    stream = np.concatenate([samples.sample(i)[:-1] for i in range(len(samples))])
    want = np.concatenate([tok.encode_documents([d])[0] for d in (docs[1], docs[2], docs[0])])
    np.testing.assert_array_equal(stream, want[: len(stream)])


def test_training_on_a_mixture_reports_tokens_per_source_and_each_validation_set(prepared, tmp_path):
    root, _ = prepared
    cfg = tiny_job(tmp_path, data=dict(
        source="shards", seq_len=16, max_bytes=None,
        sources=[dict(name="web", path=str(root / "web"), weight=3),
                 dict(name="code", path=str(root / "code"), weight=1)],
        val=[dict(name="web", path=str(root / "web")), dict(name="code", path=str(root / "code"))]),
        model=dict(vocab_size=320), train=dict(max_steps=8, eval_interval=4, micro_batch_size=8))
    result = train(cfg)
    assert result.tokens_by_source == {"web": 8 * 8 * 16 * 3 // 4, "code": 8 * 8 * 16 // 4}
    lines = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if "val/code_loss" in r]
    assert len(evals) == 3 and all(r["val_loss"] == r["val/web_loss"] for r in evals)
    assert evals[-1]["val/code_loss"] < evals[0]["val/code_loss"]
    assert lines[-1]["tokens_by_source"] == result.tokens_by_source


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(prepared, tmp_path):
    root, _ = prepared
    cfg = tiny_job(tmp_path, data=dict(source="shards", seq_len=16, max_bytes=None,
                                       sources=[dict(name="web", path=str(root / "web"))],
                                       val=[dict(name="web", path=str(root / "web"))]),
                   model=dict(vocab_size=256))
    with pytest.raises(KilnError, match="300 tokens but model.vocab_size is 256"):
        build_data(cfg, tmp_path / "run")


def test_resume_into_different_sources_or_sizes_is_refused(prepared):
    root, _ = prepared
    loader = loader_for(root, ["web", "code"], prefetch=0)
    next(loader)
    state = loader.state_dict()
    with pytest.raises(KilnError, match=r"saved for sources \['web', 'code'\]"):
        loader_for(root, ["web", "math"]).load_state_dict(state)
    with pytest.raises(KilnError, match="data.seq_len"):
        loader_for(root, ["web", "code"], seq_len=8).load_state_dict(state)


@pytest.mark.parametrize("data, message", [
    (dict(source="shards"), "needs at least one entry in data.sources"),
    (dict(source="shards", sources=[dict(name="a", path="x")],
          curriculum=[dict(until=0.5)]), "must increase and end at 1.0"),
    (dict(source="shards", sources=[dict(name="a", path="x")],
          curriculum=[dict(until=1.0, weights={"b": 1})]), "names unknown sources"),
    (dict(source="shards", seq_len=32, sources=[dict(name="a", path="x")],
          curriculum=[dict(until=1.0, seq_len=12)]), "must divide data.seq_len=32"),
])
def test_data_config_mistakes_are_named(tmp_path, data, message):
    with pytest.raises(ValidationError, match=message):
        tiny_job(tmp_path, data={**dict(max_bytes=None), **data})


def test_example_mixture_config_is_valid():
    from kiln.config import load_config

    cfg = load_config("configs/mixture.yaml")
    assert [s.name for s in cfg.data.sources] == ["web", "code", "math"]
    assert cfg.data.curriculum[-1].until == 1.0


def test_mixture_interleaving_keeps_every_prefix_within_two_samples_of_the_weights():
    rng = np.random.default_rng(0)
    for trial in range(30):
        weights = rng.random(int(rng.integers(2, 6)))
        weights /= weights.sum()
        sampler = Sampler([50] * len(weights), [Stage(2**62, weights)], 0,
                          batch_size=int(rng.integers(1, 9)))
        counts, n = np.zeros(len(weights)), 0
        for _ in range(60):
            for s, _ in sampler.next_batch()[0]:
                n += 1
                counts[s] += 1
                assert np.all(np.abs(counts - n * weights) < 2), (trial, n, counts, weights)
