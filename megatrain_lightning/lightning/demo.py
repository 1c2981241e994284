"""The embedded demo's corpus: English text that ships with every Python, so the demo needs no download.

The demo itself is an ordinary CLI run, ``megatrain fit --config configs/demo.yaml``: a 4-layer Llama
learns from ``builtin:python-docs`` (this corpus, byte tokens) with ``strategy="megatrain"``; the
:class:`~megatrain_lightning.lightning.callbacks.ExportAndSample` callback prints the validation loss before and
after, writes a Hugging Face export (with the byte tokenizer), a sample and ``loss.png``, and a
``ModelCheckpoint`` writes ``last.ckpt``.

The corpus is ``pydoc_data.topics``: ~460 kB of the Python reference documentation in English, one
document per topic.
"""

from __future__ import annotations


def python_docs() -> list[str]:
    """The topics of Python's bundled reference documentation, in a fixed order, one per document."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]
