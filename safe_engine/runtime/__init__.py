"""Members: a model, its tokenizer and per-request KV caches (local or in Ray actors), vocabularies, the
packed batched forward, and loading (hub ids, directories, GGUF files, the offline demo models)."""
