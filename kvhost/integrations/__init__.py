"""Adapters that let serving engines call kvhost in their own words.

``kvhost.integrations.vllm`` speaks vLLM's cache vocabulary for a KV connector's worker
side, and imports no engine; ``kvhost.integrations.vllm_connector`` is a connector vLLM
loads by module path (it imports vLLM, and only vLLM imports it). ``kvhost.testing``
checks a connector against real caches.
"""
