"""Text processing around a model: tokenizers, chat templates (sandboxed), detokenizing and stop strings, reasoning
and tool-call parsing, and grammar constraints."""
