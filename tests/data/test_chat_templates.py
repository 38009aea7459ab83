"""Assistant-token loss masks for stock chat templates (no `{% generation %}` markers) and for
the kit's marked template, against an independently computed span set per family."""

import json
import re

import pytest

from eagle_ray.data.chat import (
    ChatFormatError,
    assistant_spans,
    conversation_messages,
    mask_from_spans,
    read_conversations,
    tokenize_conversation,
)

# Per family, independently of eagle_ray.data.chat: what the model emits in an assistant turn, as a
# regex over the rendered text (group 1 = body + end-of-turn token).
ASSISTANT_TURN = {
    "llama3.1": r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?<\|eot_id\|>)",
    "qwen3": r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)",
    "mistral": r"\[/INST\](.*?</s>)",
    "kit": r"<\|assistant\|>\n(.*?<\|end\|>)",
}
END_OF_TURN = {"llama3.1": "<|eot_id|>", "qwen3": "<|im_end|>", "mistral": "</s>",
               "kit": "<|end|>"}
ROLE_HEADERS = {"llama3.1": ["<|start_header_id|>"], "qwen3": ["<|im_start|>"],
                "mistral": ["[INST]", "[/INST]"], "kit": ["<|assistant|>", "<|user|>"]}

MULTI_TURN = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of Peru?"},
    {"role": "assistant", "content": "The capital of Peru is Lima."},
    {"role": "user", "content": "And two plus three?"},
    {"role": "assistant", "content": "Two plus three is five."},
]
# Qwen3 drops the <think> block of turns before the last user message, keeps the last one's.
WITH_THINKING = [
    {"role": "user", "content": "What is the capital of Peru?"},
    {"role": "assistant",
     "content": "<think>\nPeru is in South America.\n</think>\n\nThe capital of Peru is Lima."},
    {"role": "user", "content": "And of Spain?"},
    {"role": "assistant", "content": "<think>Spain is in Europe.</think>It is Madrid."},
]


def expected_mask(tokenizer, family, text):
    spans = [m.span(1) for m in re.finditer(ASSISTANT_TURN[family], text, flags=re.DOTALL)]
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)[
        "offset_mapping"]
    return [int(any(s < end and e > start for start, end in spans)) for s, e in offsets]


def masked_pieces(tokenizer, ids, mask):
    """The decoded text of each run of masked tokens."""
    pieces, run = [], []
    for token, m in zip(ids + [None], mask + [0], strict=True):
        if m:
            run.append(token)
        elif run:
            pieces.append(tokenizer.decode(run))
            run = []
    return pieces


@pytest.mark.parametrize("conversation", [MULTI_TURN, WITH_THINKING], ids=["plain", "thinking"])
@pytest.mark.parametrize("family", ["llama3.1", "qwen3", "mistral", "kit"])
def test_the_mask_covers_exactly_the_assistant_turns(family_tokenizers, family, conversation):
    tokenizer = family_tokenizers[family]
    ids, mask = tokenize_conversation(tokenizer, conversation)
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert mask == expected_mask(tokenizer, family, text)
    pieces = masked_pieces(tokenizer, ids, mask)
    assert len(pieces) == 2, pieces
    for piece in pieces:
        assert piece.endswith(END_OF_TURN[family]), "the end-of-turn token is learned"
        assert not any(header in piece for header in ROLE_HEADERS[family]), piece
    assert "Lima." in pieces[0] and ("five." in pieces[1] or "Madrid." in pieces[1])


def test_qwen3_masks_what_it_renders_for_the_whole_conversation(family_tokenizers):
    tokenizer = family_tokenizers["qwen3"]
    ids, mask = tokenize_conversation(tokenizer, WITH_THINKING)
    first, last = masked_pieces(tokenizer, ids, mask)
    # The earlier turn's reasoning is not in the rendering, so it is not learned ...
    assert "South America" not in tokenizer.decode(ids)
    assert first == "The capital of Peru is Lima.<|im_end|>"
    # ... the last turn's is, with the think tags the model emits.
    assert last == "<think>\nSpain is in Europe.\n</think>\n\nIt is Madrid.<|im_end|>"


def test_mistral_masks_with_a_system_prompt_it_moves_or_drops(family_tokenizers):
    tokenizer = family_tokenizers["mistral"]
    ids, mask = tokenize_conversation(tokenizer, MULTI_TURN)
    text = tokenizer.decode(ids)
    assert "concise assistant" not in text  # the template only shows it before a final user turn
    assert masked_pieces(tokenizer, ids, mask) == ["The capital of Peru is Lima.</s>",
                                                   "Two plus three is five.</s>"]


@pytest.mark.parametrize("family", ["llama3.1", "mistral", "kit"])
def test_bos_appears_once(family_tokenizers, family):
    tokenizer = family_tokenizers[family]
    ids, _ = tokenize_conversation(tokenizer, MULTI_TURN)
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1


def test_the_template_free_method_agrees_with_generation_markers(family_tokenizers):
    tokenizer = family_tokenizers["kit"]  # its template marks assistant turns
    marked_ids, marked_mask = tokenize_conversation(tokenizer, MULTI_TURN)
    text = tokenizer.apply_chat_template(MULTI_TURN, tokenize=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    located = mask_from_spans(encoded["offset_mapping"],
                              assistant_spans(tokenizer, MULTI_TURN, text))
    assert encoded["input_ids"] == marked_ids and located == marked_mask


def test_a_conversation_without_an_answer_is_refused(family_tokenizers):
    with pytest.raises(ValueError, match="no assistant message"):
        tokenize_conversation(family_tokenizers["qwen3"], MULTI_TURN[:2])


def test_both_dataset_shapes_read_the_same(tmp_path):
    sharegpt = {"conversations": [{"from": "system", "value": MULTI_TURN[0]["content"]}] + [
        {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
        for m in MULTI_TURN[1:]]}
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": MULTI_TURN}) + "\n\n" + json.dumps(sharegpt) + "\n")
    (_, first), (where, second) = read_conversations(path)
    assert first == second == MULTI_TURN
    assert where == f"{path}:3"


@pytest.mark.parametrize("line", [
    '{"text": "hello"}',
    '{"conversations": [{"from": "robot", "value": "beep"}]}',
    '{"messages": [{"role": "user"}]}',
    '["not", "a", "mapping"]',
    "{not json",
])
def test_any_other_shape_is_an_error_naming_the_line(tmp_path, line):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": MULTI_TURN}) + "\n" + line + "\n")
    with pytest.raises(ChatFormatError, match=r"chats.jsonl:2: "):
        list(read_conversations(path))


def test_sharegpt_roles_are_mapped():
    messages = conversation_messages(
        {"conversations": [{"from": "user", "value": "q"}, {"from": "chatgpt", "value": "a"}]},
        "sample 0")
    assert [m["role"] for m in messages] == ["user", "assistant"]
