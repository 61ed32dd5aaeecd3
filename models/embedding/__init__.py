"""Embeddings and reranking: the sentence-transformers pipeline around an encoder or a decoder embedder, and
cross-encoder rerankers."""
