"""Chat templates: a conversation -> token ids and which of them the model is trained on.

A template is rendered as `transformers` renders it (`apply_chat_template`): Jinja in a
sandbox with trim_blocks and lstrip_blocks, the loop-controls extension, `raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML, and the tokenizer's special tokens
(bos_token, eos_token, ...) as variables; the text is then tokenized without adding special
tokens. So the ids are those `tokenizer.apply_chat_template(messages)` gives.

Assistant turns are found by rendering incrementally: turn i spans from the end of the
conversation before it rendered with the generation prompt to the end of the conversation
through it, i.e. the reply and whatever the template closes it with (an EOS, `<|im_end|>\\n`).
A token is trained on when its characters overlap such a span (the rule transformers uses for
`return_assistant_tokens_mask`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

import numpy as np

from kiln.data.tokenizer import TokenizerInfo
from kiln.errors import KilnError

ROLES = ("system", "user", "assistant")

# kiln's template for tokenizers without one: plain-text headers, the reply closed by EOS.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "### Assistant:\n{{ message['content'] }}{{ eos_token }}"
    "{% else %}"
    "### {{ message['role'] | capitalize }}:\n{{ message['content'] }}\n\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}")

PROMPT, TURN, LAST_TURN = 0, 1, 2
"""Mask values: a prompt or template token; a token of an assistant turn; of the last one."""


@dataclass
class Encoded:
    ids: np.ndarray
    """Token ids of the whole rendered conversation."""
    mask: np.ndarray
    """uint8 per token: PROMPT, TURN or LAST_TURN."""


@lru_cache(maxsize=8)
def compile_template(source: str):
    """A Jinja template compiled in transformers' environment; KilnError for a syntax error."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise KilnError(f"the chat template has a Jinja syntax error at line {e.lineno}: "
                        f"{e.message}") from None


class ChatFormat:
    """Renders conversations with one template and tokenizer, and masks the assistant turns."""

    def __init__(self, tokenizer: TokenizerInfo, template: str | None = None):
        self.tokenizer = tokenizer
        self.source = template or tokenizer.chat_template or DEFAULT_TEMPLATE
        self.kind = ("given" if template else "tokenizer's" if tokenizer.chat_template
                     else "kiln default")
        self.template = compile_template(self.source)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.tokenizer.special_tokens)
        except jinja2.TemplateError as e:
            raise KilnError(f"the {self.kind} chat template refused the conversation: "
                            f"{e}") from None

    def encode(self, messages: list[dict]) -> Encoded:
        """Ids and mask of a conversation whose messages were checked (`check_messages`)."""
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
            if not (text.startswith(prompt) and text.startswith(through)
                    and len(prompt) <= len(through)):
                raise KilnError(
                    f"the {self.kind} chat template renders turn {i + 1} differently depending "
                    "on the turns after it, so the assistant's tokens cannot be found by "
                    "rendering the conversation turn by turn; give a template that does not "
                    "(kiln prepare --chat-template FILE)")
            spans.append((len(prompt), len(through)))
        encoding = self.tokenizer.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        mask = np.zeros(len(ids), dtype=np.uint8)
        if spans:
            offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
            for k, (a, b) in enumerate(spans):
                inside = (offsets[:, 1] > a) & (offsets[:, 0] < b)
                mask[inside] = LAST_TURN if k == len(spans) - 1 else TURN
        return Encoded(ids, mask)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The ids a model continues to write the next assistant turn (generation prompt)."""
        text = self.render(messages, add_generation_prompt=True)
        return self.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids


def check_messages(messages, where: str) -> list[dict]:
    """The messages as plain {role, content} dicts; KilnError naming `where` if malformed."""
    if not isinstance(messages, list):
        raise KilnError(f"{where}: 'messages' is a {type(messages).__name__}, not a list of "
                        "{role, content} objects")
    if not messages:
        raise KilnError(f"{where}: 'messages' is empty")
    out = []
    for n, message in enumerate(messages, 1):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise KilnError(f"{where}: message {n} is not an object with 'role' and 'content'")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise KilnError(f"{where}: message {n} has role {role!r}; roles are "
                            f"{', '.join(ROLES)}")
        if not isinstance(content, str):
            raise KilnError(f"{where}: message {n} content is a {type(content).__name__}, "
                            "not a string")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise KilnError(f"{where}: no assistant message, so nothing to train on")
    return out
