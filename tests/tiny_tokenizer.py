"""A tiny byte-level tokenizer with real chat templates, built in code for unit tests.

Byte-level BPE with no merges: one token per UTF-8 byte (256) plus the special tokens, so the vocab
stays under 400 and a random model with vocab 512 can consume it. Offsets map to characters as in
any fast tokenizer, which is what the template-agnostic loss mask relies on.

Templates:
- ``chatml``: SmolLM2-135M-Instruct's template verbatim (copied from the converted checkpoint),
  including its default system prompt and the ``\\n`` after every ``<|im_end|>``.
- ``llama3``: Llama-3 header style, BOS first, content trimmed, ``<|eot_id|>`` with nothing after.
- ``plain-default-system``: Vicuna-v1.1 style, no special header tokens, a default system prompt,
  and the space between ``ASSISTANT:`` and the answer rendered as part of the assistant turn.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

PLAIN_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% set rest = messages[1:] %}"
    "{% else %}{{ 'A chat between a curious user and an artificial intelligence assistant.' }}"
    "{% set rest = messages %}{% endif %}"
    "{% for message in rest %}{% if message['role'] == 'user' %}{{ ' USER: ' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ASSISTANT: ' + message['content'] + '<|endoftext|>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ ' ASSISTANT:' }}{% endif %}"
)

# template -> (chat template, special tokens, tokenizer kwargs)
_VARIANTS = {
    "chatml": (
        CHATML_TEMPLATE,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        # Same special-token roles as the converted SmolLM2 tokenizer.
        dict(bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<|endoftext|>"),
    ),
    "llama3": (
        LLAMA3_TEMPLATE,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|endoftext|>"],
        dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|endoftext|>"),
    ),
    "plain-default-system": (
        PLAIN_TEMPLATE,
        ["<|endoftext|>"],
        dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>"),
    ),
}


def make_tiny_tokenizer(template: str = "chatml") -> PreTrainedTokenizerFast:
    chat_template, specials, kwargs = _VARIANTS[template]
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)  # ids 256.. in list order
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    tokenizer.chat_template = chat_template
    return tokenizer
