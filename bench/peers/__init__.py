"""The peer benchmark: specfire, transformers and ExLlamaV3 on one checkpoint (python -m bench.peers.run)."""
