"""Data: corpora (the default one is found on this machine), tokenizers, packing into cu_seqlens batches,
and synthetic recall tasks."""

from k3.data.corpus import Document, load_corpus, split_validation
from k3.data.packing import BatchStream, PackedBatch, pack_rows
from k3.data.synthetic import RecallTask, recall_accuracy
from k3.data.tokenizer import Tokenizer, load_tokenizer, train_bpe

__all__ = ["Document", "load_corpus", "split_validation", "BatchStream", "PackedBatch", "pack_rows",
           "RecallTask", "recall_accuracy", "Tokenizer", "load_tokenizer", "train_bpe"]
