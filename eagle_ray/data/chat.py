"""Chat conversations -> token ids and an assistant-token loss mask, for any chat template.

The draft learns what the target emits: the assistant's turns, exactly as the model's own chat
template renders them for the whole conversation (not the role header the template writes before
a turn, which the model never generates). The mask therefore covers, per assistant turn,
everything after the template's generation prompt up to and including the turn's end-of-turn
token.

Templates that mark assistant turns with `{% generation %}` say so themselves. The stock Llama-3,
Qwen2.5/Qwen3 and Mistral templates do not; for them the turns are located without per-family
code, and without rendering prefixes of the conversation (which is wrong wherever a template
renders earlier turns differently once later ones exist: Qwen3 drops `<think>` blocks of turns
before the last user message, Mistral moves the system prompt into the last user turn):

1. Render the conversation twice: as it is, and with every assistant content replaced by a
   unique sentinel. The text between sentinels is what the template writes around the turns.
2. Cut from that text what the template writes between the generation prompt and an assistant
   turn's content (Mistral's space after `[/INST]`, Qwen3's empty `<think>` block on the final
   turn): the model emits it, so it belongs to the turn.
3. Find each cut piece, in order, in the real rendering: between two pieces lies one assistant
   turn's rendered body. The first token after it is the end-of-turn token.

The text is tokenised once with the tokenizer's offset mapping and without adding special tokens
(the template writes BOS itself where the model wants one; adding another would double it).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# ShareGPT speaker names -> chat roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
                  "system": "system"}
_GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")
_SENTINEL = "@@eagle_ray-assistant-turn-{}@@"


class ChatFormatError(ValueError):
    """A conversation is not in a shape the data pipeline reads; the message names where."""


class NoAssistantTurn(ValueError):
    """A conversation has nothing for the draft to learn (no assistant message)."""


def read_conversations(path: str | Path) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """`(where, messages)` for every conversation of a chat file: JSONL, or one JSON array (as
    ShareGPT dumps often are).

    Each line (or array entry) is `{"messages": [{"role", "content"}, ...]}` or ShareGPT's
    `{"conversations": [{"from", "value"}, ...]}`; `where` is `file:line` (or `file[index]`)
    for error messages.
    """
    if is_json_array(path):
        with open(path) as f:
            try:
                samples = json.load(f)
            except json.JSONDecodeError as e:
                raise ChatFormatError(f"{path}: not a valid JSON array ({e})") from e
        for index, sample in enumerate(samples):
            yield f"{path}[{index}]", conversation_messages(sample, f"{path}[{index}]")
        return
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                sample = json.loads(line)
            except json.JSONDecodeError as e:
                raise ChatFormatError(f"{where}: not valid JSON ({e})") from e
            yield where, conversation_messages(sample, where)


def is_json_array(path: str | Path) -> bool:
    """Whether a chat file is one JSON array (its first non-blank character is `[`), not
    JSONL."""
    with open(path) as f:
        while (char := f.read(1)).isspace():
            pass
    return char == "["


def conversation_messages(sample: Any, where: str) -> list[dict[str, Any]]:
    """A sample in either accepted shape as `[{"role", "content"}, ...]`: `content` a string,
    or (image-text chats, as Hugging Face processors take them) a list of `{"type": "text",
    "text"}` and `{"type": "image", "image"}` items."""
    if isinstance(sample, dict) and isinstance(sample.get("messages"), list):
        messages = sample["messages"]
        if all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            return [{"role": m["role"], "content": content_items(m.get("content"), where)}
                    for m in messages]
        raise ChatFormatError(f"{where}: every entry of 'messages' needs a string 'role' and "
                              f"'content'")
    if isinstance(sample, dict) and isinstance(sample.get("conversations"), list):
        messages = []
        for turn in sample["conversations"]:
            speaker = turn.get("from") if isinstance(turn, dict) else None
            if speaker not in SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
                raise ChatFormatError(
                    f"{where}: ShareGPT turn {turn!r:.80} needs 'from' in "
                    f"{sorted(SHAREGPT_ROLES)} and a string 'value'")
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn["value"]})
        return messages
    keys = sorted(sample) if isinstance(sample, dict) else type(sample).__name__
    raise ChatFormatError(
        f"{where}: expected {{\"messages\": [{{\"role\", \"content\"}}, ...]}} or ShareGPT's "
        f"{{\"conversations\": [{{\"from\", \"value\"}}, ...]}}, got {keys}")


def content_items(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: a string as it is, or a list of text / image items with the fields
    each needs (Arrow gives every item every field, None where unset: those are dropped, or a
    template's `'image' in item` would see an image in every text item). OpenAI's
    `{"type": "image_url", "image_url": {"url"}}` becomes an image item."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list | tuple):
        raise ChatFormatError(f"{where}: every entry of 'messages' needs a string 'role' and "
                              f"'content' (a string or a list of text and image items)")
    items = []
    for item in content:
        item = {k: v for k, v in item.items() if v is not None} if isinstance(item, dict) else {}
        if item.get("type") == "image_url" or (not item.get("type") and "image_url" in item):
            url = item.get("image_url")
            item = {"type": "image", "image": url.get("url") if isinstance(url, dict) else url}
        kind = item.get("type") or ("image" if "image" in item else "text")
        if kind == "text" and isinstance(item.get("text"), str):
            items.append({**item, "type": "text"})
        elif kind == "image" and item.get("image") is not None:
            items.append({**item, "type": "image"})
        else:
            raise ChatFormatError(f"{where}: content item {item!r:.80} is neither "
                                  f"{{\"type\": \"text\", \"text\"}} nor "
                                  f"{{\"type\": \"image\", \"image\"}}")
    return items


def conversation_key(messages: list[dict[str, Any]]) -> str:
    """A content hash that identifies a conversation (e.g. to keep held-out ones out); image
    bytes count by their own hash."""
    return hashlib.sha1(json.dumps(messages, sort_keys=True, default=_bytes_key).encode()
                        ).hexdigest()


def _bytes_key(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return hashlib.sha1(value).hexdigest()
    raise TypeError(f"{type(value).__name__} in a conversation")


def has_generation_markers(tokenizer) -> bool:
    """Does the chat template mark assistant turns with `{% generation %}`?"""
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(_GENERATION_MARKER.search(template))


def tokenize_conversation(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of the conversation as the chat template renders it, and a 0/1 mask that is 1
    on every assistant-turn token (see the module docstring). Raises `NoAssistantTurn`, the
    template's own errors, or ValueError when the turns cannot be located."""
    if not any(m["role"] == "assistant" for m in messages):
        raise NoAssistantTurn("the conversation has no assistant message")
    if has_generation_markers(tokenizer):
        encoded = tokenizer.apply_chat_template(messages, return_dict=True,
                                                return_assistant_tokens_mask=True)
        return list(encoded["input_ids"]), list(encoded["assistant_masks"])
    text = _render(tokenizer, messages)
    spans = assistant_spans(tokenizer, messages, text)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), mask_from_spans(encoded["offset_mapping"], spans)


def assistant_spans(tokenizer, messages: list[dict[str, str]], text: str
                    ) -> list[tuple[int, int]]:
    """`(start, end)` character spans of each assistant turn's body in `text` (the template's
    rendering of `messages`): from where the generation prompt ends to the start of what the
    template writes after the turn (its end-of-turn marker)."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    probe = [dict(m) for m in messages]
    for k, i in enumerate(turns):
        probe[i]["content"] = _SENTINEL.format(k)
    pieces = _split_at_sentinels(_render(tokenizer, probe), len(turns))
    lead = assistant_lead(tokenizer)
    spans, cursor = [], 0
    for k, piece in enumerate(pieces[:-1]):
        # What the template writes after the generation prompt belongs to the turn.
        anchor = piece[:len(piece) - len(lead)] if lead and piece.endswith(lead) else piece
        found = text.find(anchor, cursor)
        if found < 0:
            raise ValueError(f"could not align the chat template's text around assistant turn "
                             f"{k} with its rendering of the conversation")
        if k:
            spans.append((cursor, found))
        cursor = found + len(anchor)
    tail = pieces[-1]
    if not text.endswith(tail) or len(text) - len(tail) < cursor:
        raise ValueError("could not align the chat template's text after the last assistant "
                         "turn with its rendering of the conversation")
    spans.append((cursor, len(text) - len(tail)))
    return spans


def mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]],
                    end_token: bool = True) -> list[int]:
    """1 on tokens overlapping a span, and (`end_token`) on the first token starting at or after
    its end (the end-of-turn token); 0 elsewhere."""
    mask = [0] * len(offsets)
    for start, end in spans:
        for t, (token_start, token_end) in enumerate(offsets):
            if token_start >= end:  # the end-of-turn token
                mask[t] = int(end_token) or mask[t]
                break
            if token_end > start:
                mask[t] = 1
    return mask


def assistant_lead(tokenizer) -> str:
    """What the template writes between the generation prompt and a final assistant turn's
    content: the model emits it, so it belongs to the turn. Empty for most templates; Mistral's
    `" "` after `[/INST]`, Qwen3's `<think>\\n\\n</think>\\n\\n`."""
    user = [{"role": "user", "content": _SENTINEL.format("user")}]
    answer = _SENTINEL.format("answer")
    prompt = _render(tokenizer, user, add_generation_prompt=True)
    answered = _render(tokenizer, user + [{"role": "assistant", "content": answer}])
    if not answered.startswith(prompt) or answer not in answered[len(prompt):]:
        raise ValueError("the chat template's generation prompt is not how it renders an "
                         "assistant turn; cannot locate assistant turns (mark them with "
                         "{% generation %} ... {% endgeneration %} in the template)")
    return answered[len(prompt):answered.index(answer)]


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Tokens that end an assistant turn when generating: the first token the template writes
    after an answer (`<|eot_id|>`, `<|im_end|>`, `</s>`, ...) and the tokenizer's EOS."""
    answer = _SENTINEL.format("answer")
    rendered = _render(tokenizer, [{"role": "user", "content": _SENTINEL.format("user")},
                                   {"role": "assistant", "content": answer}])
    after = rendered[rendered.index(answer) + len(answer):]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
    return tuple(dict.fromkeys([*ids, *([tokenizer.eos_token_id]
                                         if tokenizer.eos_token_id is not None else [])]))


def prompt_for_turn(tokenizer, messages: list[dict[str, str]], turn: int) -> list[int]:
    """Token ids of `messages[:turn]` with the generation prompt: what the target answers."""
    return list(tokenizer.apply_chat_template(messages[:turn], add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def _render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False
            ) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _split_at_sentinels(text: str, count: int) -> list[str]:
    """The text before, between and after the sentinels of turns 0..count-1 (count + 1 pieces)."""
    pieces, cursor = [], 0
    for k in range(count):
        sentinel = _SENTINEL.format(k)
        if text.count(sentinel) != 1:
            raise ValueError(f"the chat template renders assistant turn {k} "
                             f"{text.count(sentinel)} times; expected once")
        found = text.index(sentinel)
        if found < cursor:
            raise ValueError("the chat template renders assistant turns out of order")
        pieces.append(text[cursor:found])
        cursor = found + len(sentinel)
    pieces.append(text[cursor:])
    return pieces
