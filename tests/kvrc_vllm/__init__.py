"""Tests with real vLLM engines (pytest marker `vllm`): KvrcConnector end to end."""
