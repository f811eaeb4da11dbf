"""A small local chat tokenizer and conversations, shared by the chat, streaming and LoRA tests (no
network)."""

import json

from hf_noloco.data.corpus import train_bpe_tokenizer

# ChatML, as Qwen's: a default system turn when there is none. The `{% generation %}` markers let transformers
# compute its own assistant mask, the independent reference the tests compare against; hf_noloco does not need
# them.
CHATML = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama-3's layout, without generation markers (as the real one).
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "judge",
    "boxing",
    "matches",
]


def sentence(i: int, length: int) -> str:
    return " ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(length)).capitalize() + "."


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` conversations of one to three exchanges, some with a system turn, of varied lengths."""
    out = []
    for i in range(n):
        k = i + seed
        messages = [{"role": "system", "content": sentence(k, 4)}] if k % 3 == 0 else []
        for turn in range(1 + k % 3):
            messages.append({"role": "user", "content": sentence(k + turn, 3 + (k + turn) % 7)})
            messages.append(
                {"role": "assistant", "content": sentence(k + 2 * turn + 1, 2 + (k * 3 + turn) % 11)}
            )
        out.append(messages)
    return out


def chat_tokenizer(template: str = CHATML, vocab_size: int = 400):
    """A byte-level BPE tokenizer with ChatML's (and Llama-3's) special tokens and ``template``."""
    texts = [m["content"] for c in conversations(60) for m in c]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=vocab_size)
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                "<|im_start|>",
                "<|im_end|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
            ]
        }
    )
    tokenizer.chat_template = template
    return tokenizer


def write_chat_jsonl(path, n: int, seed: int = 0) -> list[list[dict]]:
    convs = conversations(n, seed)
    with open(path, "w") as f:
        for messages in convs:
            f.write(json.dumps({"messages": messages}) + "\n")
    return convs
