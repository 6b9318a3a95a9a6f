"""Tasks from local JSONL files, one example a line, scored the way lm-evaluation-harness does.

    {"question": "2 + 2 =", "choices": ["3", "4"], "answer": 1}    multiple choice
    {"prompt": "Q: capital of France?\\nA:", "answer": "Paris"}      generation ("until": ["\\n"])
    {"text": "a held-out document"}                                 loss and perplexity

Multiple choice: each choice is scored by the summed log-likelihood of " " + choice after the
question (the harness's target delimiter; trailing spaces of the question move into the
continuation). `acc`: the highest sum is the answer. `acc_norm`: the highest sum divided by
the choice's length in characters (`len(choice)`, as the harness's acc_norm does); `acc_bytes`
divides by its UTF-8 byte length instead (the harness's acc_bytes). Generation: greedy, with a
KV cache, cut at the first `until` string; `exact_match` (stripped strings equal) and
`contains` (the answer appears in the output).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kiln.data.tokenizer import TokenizerInfo
from kiln.errors import KilnError
from kiln.eval.generate import greedy_generate


@dataclass
class Task:
    name: str
    choice: list[dict] = field(default_factory=list)
    generation: list[dict] = field(default_factory=list)
    text: list[str] = field(default_factory=list)


def load_task(path: str | Path) -> Task:
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise KilnError(f"cannot read task file {path}: {e.strerror or e}") from None
    task = Task(path.stem)
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {n}"
        try:
            ex = json.loads(line)
        except json.JSONDecodeError as e:
            raise KilnError(f"{where}, column {e.colno}: not valid JSON ({e.msg})") from None
        if not isinstance(ex, dict):
            raise KilnError(f"{where}: expected a JSON object, got {type(ex).__name__}")
        if "choices" in ex:
            choices, answer = ex.get("choices"), ex.get("answer")
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise KilnError(f"{where}: 'choices' must be a non-empty list of strings")
            if not (isinstance(answer, int) and 0 <= answer < len(choices)):
                raise KilnError(f"{where}: 'answer' must be the index of the right choice "
                                f"(0..{len(choices) - 1}), got {answer!r}")
            task.choice.append({"question": str(ex.get("question", "")), "choices": choices,
                                "answer": answer})
        elif "answer" in ex:
            prompt = ex.get("prompt", ex.get("question"))
            if not isinstance(prompt, str) or not isinstance(ex["answer"], str):
                raise KilnError(f"{where}: a generation example needs 'prompt' (or 'question') "
                                "and 'answer' as strings")
            until = ex.get("until", ["\n"])
            task.generation.append({"prompt": prompt, "answer": ex["answer"], "until": until})
        elif isinstance(ex.get("text"), str):
            task.text.append(ex["text"])
        else:
            raise KilnError(f"{where}: expected 'question'+'choices'+'answer' (multiple choice), "
                            "'prompt'+'answer' (generation) or 'text' (held-out loss)")
    return task


def _prefix(tok: TokenizerInfo) -> list[int]:
    return [tok.bos_id] if tok.bos_id is not None else []


def _encode(tok: TokenizerInfo, text: str) -> list[int]:
    return tok.tokenizer.encode(text, add_special_tokens=False).ids


def encode_pair(tok: TokenizerInfo, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as the harness splits them: the pair is encoded whole,
    so a token spanning the boundary belongs to the continuation."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = _encode(tok, context + continuation)
    ctx = _encode(tok, context)
    head = _prefix(tok) or ([tok.eos_id] if not ctx else [])  # an empty context starts at EOS
    return head + ctx, whole[len(ctx):]


@torch.no_grad()
def loglikelihoods(model: nn.Module, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """Summed log-probability of each continuation after its context (one padded batch)."""
    limit = model.cfg.max_seq_len
    device = model.embed.weight.device
    rows, spans = [], []
    for ctx, cont in pairs:
        seq = (ctx + cont)[-(limit + 1):]
        rows.append(seq[:-1])
        spans.append((len(seq) - 1 - len(cont), seq[len(seq) - len(cont):]))
    width = max(len(r) for r in rows)
    # Right padding: causal attention keeps it from touching the real positions.
    batch = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)
    logprobs = F.log_softmax(model(batch).float(), dim=-1)
    out = []
    for i, (start, cont) in enumerate(spans):
        picked = logprobs[i, start: start + len(cont)].gather(-1, torch.tensor(cont, device=device)[:, None])
        out.append(float(picked.sum()))
    return out


def score_choice(model: nn.Module, tok: TokenizerInfo, examples: list[dict]) -> dict[str, float]:
    hits = {"acc": 0, "acc_norm": 0, "acc_bytes": 0}
    for ex in examples:
        lls = loglikelihoods(model, [encode_pair(tok, ex["question"], " " + c) for c in ex["choices"]])
        chars = [float(len(c)) for c in ex["choices"]]
        nbytes = [float(len(c.encode())) for c in ex["choices"]]
        for name, scores in (("acc", lls), ("acc_norm", [l / n for l, n in zip(lls, chars)]),
                             ("acc_bytes", [l / n for l, n in zip(lls, nbytes)])):
            hits[name] += int(max(range(len(scores)), key=scores.__getitem__) == ex["answer"])
    return {k: v / len(examples) for k, v in hits.items()}


def score_generation(model: nn.Module, tok: TokenizerInfo, examples: list[dict],
                     max_new_tokens: int = 32) -> dict[str, float]:
    exact = contains = 0
    for ex in examples:
        ids = greedy_generate(model, _prefix(tok) + _encode(tok, ex["prompt"]), max_new_tokens,
                              {tok.eos_id})
        text = tok.tokenizer.decode(ids)
        for stop in ex["until"]:
            text = text.split(stop)[0] if stop else text
        exact += int(text.strip() == ex["answer"].strip())
        contains += int(ex["answer"].strip() in text)
    return {"exact_match": exact / len(examples), "contains": contains / len(examples)}


@torch.no_grad()
def score_text(model: nn.Module, tok: TokenizerInfo, texts: list[str]) -> dict[str, float]:
    """Mean next-token loss over documents ([bos] + text + [eos], in max_seq_len windows)."""
    limit = model.cfg.max_seq_len
    device = model.embed.weight.device
    total, count = 0.0, 0
    for ids in tok.encode_documents(texts):
        for start in range(0, max(len(ids) - 1, 1), limit):
            window = torch.tensor([ids[start: start + limit + 1]], device=device)
            if window.shape[1] < 2:
                continue
            logits = model(window[:, :-1]).float()
            total += float(F.cross_entropy(logits[0], window[0, 1:], reduction="sum"))
            count += window.shape[1] - 1
    loss = total / max(count, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50)), "tokens": float(count)}


def run_tasks(model: nn.Module, tok: TokenizerInfo, paths: list[str | Path],
              max_new_tokens: int = 32) -> dict[str, float]:
    """Every task's scores as flat metrics: eval/<task>/acc, eval/<task>/loss, ..."""
    was_training = model.training
    model.eval()
    out: dict[str, float] = {}
    try:
        for path in paths:
            task = load_task(path)
            parts = []
            if task.choice:
                parts.append(score_choice(model, tok, task.choice))
            if task.generation:
                parts.append(score_generation(model, tok, task.generation, max_new_tokens))
            if task.text:
                parts.append(score_text(model, tok, task.text))
            for part in parts:
                out.update({f"eval/{task.name}/{k}": v for k, v in part.items()})
    finally:
        model.train(was_training)
    return out
