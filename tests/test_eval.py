"""Evaluation: the KV-cache decode against the full forward, and tasks scored on a hand-set
model whose preferences are known."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from kiln.config import ModelConfig
from kiln.data.tokenizer import describe
from kiln.eval.generate import KVCache, forward_cached, greedy_generate
from kiln.eval.tasks import encode_pair, loglikelihoods, run_tasks
from kiln.models.transformer import Transformer

WORDS = ["<|endoftext|>", "Q1", "Q2", "red", "blue", "green", "big", "dog", "cat",
         "w9", "w10", "w11", "w12", "w13", "w14", "w15"]
ID = {w: i for i, w in enumerate(WORDS)}
# Each word's strongly preferred next word: a bigram table.
PREFERRED = {"Q1": "red", "Q2": "Q1", "red": "<|endoftext|>", "blue": "green", "green": "big",
             "big": "dog", "dog": "Q1", "cat": "<|endoftext|>"}
STRENGTH = 10.0


def word_tokenizer():
    tok = Tokenizer(models.WordLevel(ID, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return describe(tok)


def bigram_model() -> Transformer:
    """Blocks that add nothing, one-hot embeddings, and an output layer holding the bigram
    table: the logits after word w are STRENGTH on PREFERRED[w], 0 elsewhere."""
    v = len(WORDS)
    cfg = ModelConfig(vocab_size=v, dim=v, n_layers=2, n_heads=2, n_kv_heads=1,
                      intermediate_size=8, max_seq_len=32, norm_eps=1e-12)
    model = Transformer(cfg)
    model.init_weights(0)
    with torch.no_grad():
        for block in model.layers.values():
            block.attn.o.weight.zero_()
            block.mlp.down.weight.zero_()
        model.embed.weight.copy_(torch.eye(v))
        model.norm.weight.fill_(1.0)
        # RMSNorm scales a one-hot vector by sqrt(v): undo it so the logit is STRENGTH.
        table = torch.zeros(v, v)
        for cur, nxt in PREFERRED.items():
            table[ID[nxt], ID[cur]] = STRENGTH / math.sqrt(v)
        model.lm_head.weight.copy_(table)
    return model.eval()


def bigram_logprob(cur: str, nxt: str) -> float:
    """log p(nxt | cur) from the table alone, independently of the model code."""
    logits = [STRENGTH if PREFERRED.get(cur) == w else 0.0 for w in WORDS]
    return logits[ID[nxt]] - math.log(sum(math.exp(x) for x in logits))


def expected_ll(question: str, choice: str) -> float:
    words = question.split() + choice.split()
    start = len(question.split())
    return sum(bigram_logprob(words[i - 1], words[i]) for i in range(start, len(words)))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_kv_cache_decode_equals_the_full_forward(qk_norm):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      intermediate_size=48, max_seq_len=32, qk_norm=qk_norm, qkv_bias=qk_norm)
    model = Transformer(cfg)
    model.init_weights(1)
    model.eval()
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        full = model(tokens)
    cache = KVCache(model, 2, 12)
    pieces = [forward_cached(model, tokens[:, :5], cache)]  # a prompt, then one token at a time
    pieces += [forward_cached(model, tokens[:, i:i + 1], cache) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)
    # Greedy decoding with the cache picks what the full forward picks at every step.
    prompt, out = tokens[0, :4].tolist(), []
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert greedy_generate(model, prompt, 8) == seq[4:]


def test_loglikelihoods_follow_the_hand_set_table():
    model, tok = bigram_model(), word_tokenizer()
    cases = [("Q1", "red"), ("Q2", "blue green big dog cat"), ("Q1", "blue green")]
    got = loglikelihoods(model, [encode_pair(tok, q, " " + c) for q, c in cases])
    assert got == pytest.approx([expected_ll(q, c) for q, c in cases], abs=1e-4)


def test_multiple_choice_acc_and_acc_norm_as_the_harness_defines_them(tmp_path):
    model, tok = bigram_model(), word_tokenizer()
    task = tmp_path / "colors.jsonl"
    examples = [
        # The model prefers "red" after Q1: both metrics pick it.
        {"question": "Q1", "choices": ["red", "blue green"], "answer": 0},
        # After Q2, "red" costs one unlikely step (-10) and 3 characters (-3.3/char); the long
        # choice costs two (-20) over 22 characters (-0.9/char): acc picks the short one,
        # acc_norm (per character) the long one, which is the answer.
        {"question": "Q2", "choices": ["red", "blue green big dog cat"], "answer": 1},
    ]
    task.write_text("".join(json.dumps(e) + "\n" for e in examples))
    lls = [expected_ll("Q2", c) for c in examples[1]["choices"]]
    assert lls[0] > lls[1] and lls[0] / 3 < lls[1] / 22  # the premise, from the table alone
    scores = run_tasks(model, tok, [task])
    assert scores["eval/colors/acc"] == 0.5
    assert scores["eval/colors/acc_norm"] == 1.0
    assert scores["eval/colors/acc_bytes"] == 1.0  # ASCII: bytes = characters


def test_generation_exact_match_and_contains(tmp_path):
    model, tok = bigram_model(), word_tokenizer()
    task = tmp_path / "gen.jsonl"
    task.write_text("".join(json.dumps(e) + "\n" for e in [
        {"prompt": "Q1", "answer": "red"},               # red, then EOS: exact
        {"prompt": "blue", "answer": "big"},             # green big dog Q1 red: contains only
        {"prompt": "Q2", "answer": "cat"},               # Q1 red: neither
    ]))
    scores = run_tasks(model, tok, [task], max_new_tokens=8)
    assert scores["eval/gen/exact_match"] == pytest.approx(1 / 3)
    assert scores["eval/gen/contains"] == pytest.approx(2 / 3)


def test_held_out_text_loss_matches_the_table(tmp_path):
    model, tok = bigram_model(), word_tokenizer()
    task = tmp_path / "text.jsonl"
    task.write_text(json.dumps({"text": "blue green big cat"}) + "\n")
    scores = run_tasks(model, tok, [task])
    words = ["blue", "green", "big", "cat", "<|endoftext|>"]  # the document, then EOS
    expected = -sum(bigram_logprob(a, b) for a, b in zip(words, words[1:])) / 4
    assert scores["eval/text/loss"] == pytest.approx(expected, rel=1e-4)
    assert scores["eval/text/tokens"] == 4


def test_bad_task_line_is_a_clear_error(tmp_path):
    from kiln.errors import KilnError

    task = tmp_path / "bad.jsonl"
    task.write_text('{"question": "Q1", "choices": ["red"], "answer": 3}\n')
    with pytest.raises(KilnError, match=r"bad.jsonl, line 1: 'answer' must be the index"):
        run_tasks(bigram_model(), word_tokenizer(), [task])
