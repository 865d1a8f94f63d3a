"""The text a draft head learns from by default: what ships with Python itself, shaped like chat
answers (`--corpus sharegpt` reads real chat instead: sharegpt.py).

EAGLE and Medusa train on conversations (ShareGPT) and Medusa-2 on the
target's own answers; ShareGPT needs a package installed, and generating answers with a
1.5B target on a CPU runs at a few tokens a second. What every install has is
Python's standard library: its source (code, as the coder target writes) and
pydoc's topic texts (the language reference in English prose). Each document
becomes one chat turn, a question and the document as the assistant's
answer, so the head also learns the chat template's tokens. The bench
prompts (HumanEval, MT-bench) are deliberately not used: that would be
training on the test set.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path


def stdlib_documents(max_chars: int = 6000) -> list[tuple[str, str]]:
    """(question, answer) pairs: pydoc topics and standard-library modules, cut to max_chars."""
    import pydoc_data.topics

    documents = [(f"Explain the Python topic '{name}'.", text.strip()[:max_chars])
                 for name, text in sorted(pydoc_data.topics.topics.items()) if len(text.strip()) > 200]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        source = path.read_text(encoding="utf-8", errors="replace").strip()
        if len(source) > 500:
            documents.append((f"Show me the source of Python's {path.stem} module.",
                              f"```python\n{source[:max_chars]}\n```"))
    return documents


def chat_texts(tokenizer, documents: list[tuple[str, str]] | list[list[dict[str, str]]], seed: int = 0
               ) -> list[str]:
    """Each (question, answer) pair or conversation (chat messages) through the tokenizer's chat
    template (plain text when it has none), shuffled."""
    texts = []
    for document in documents:
        messages = document if isinstance(document, list) else [
            {"role": "user", "content": document[0]}, {"role": "assistant", "content": document[1]}]
        try:
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
        except (AttributeError, ValueError):
            texts.append("\n\n".join(message["content"] for message in messages))
    random.Random(seed).shuffle(texts)
    return texts


def token_chunks(tokenizer, texts: list[str], seq_len: int, max_tokens: int, pack: bool = False
                 ) -> list[list[int]]:
    """Fixed-length windows of seq_len tokens (documents cut, short tails dropped), up to max_tokens.

    pack: the texts are first joined into one stream, so conversations shorter than a window
    (the target's own answers) are kept, several to a window, instead of dropped."""
    chunks: list[list[int]] = []
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    if pack:
        encoded = [[token for ids in encoded for token in ids]]
    for ids in encoded:
        for start in range(0, len(ids) - seq_len // 4, seq_len):
            window = ids[start: start + seq_len]
            if len(window) == seq_len:
                chunks.append(window)
            if len(chunks) * seq_len >= max_tokens:
                return chunks
    return chunks
