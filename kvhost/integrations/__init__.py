"""Adapters that let serving engines call kvhost in their own words.

``kvhost.integrations.vllm`` speaks vLLM's cache vocabulary for a KV connector's worker
side; ``kvhost.integrations.testing`` checks a connector against real caches. Neither
imports an engine.
"""
