"""Images in prompts: reading them, and the vision encoders (SigLIP, Mllama's) that turn them into embeddings."""
