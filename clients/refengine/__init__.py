"""The reference engine: a real, model-free serving engine for kvrc's flows.

One process per rank part (`kvrc engine --role prefill|decode ...`). See
`clients/refengine/engine.py` for how rank parts of one engine cooperate.
`channel.py`, `options.py` and `blocks.py` import without torch (the CLI
and the demo orchestrator rely on that).
"""
