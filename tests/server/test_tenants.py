"""Tenants: the same cache_salt and key share cached KV; a different salt or key never does."""

from __future__ import annotations

import random

import httpx
from server_helpers import API_KEYS

BLOCK_SIZE = 16


def _prompt(seed: int, num_tokens: int = 5 * BLOCK_SIZE + 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(num_tokens)]


def _cached(url: str, key: str, prompt: list[int], salt: str | None = None) -> int:
    body: dict = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(url + "/v1/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    details = r.json()["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] == sum(details["cached_tokens_by_tier"].values())
    return details["cached_tokens"]


def test_cache_salt_separates_and_same_salt_shares(server) -> None:
    key = API_KEYS[0]
    prompt = _prompt(1)
    full_blocks = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert _cached(server.url, key, prompt, "tenant-1") == 0  # never seen: a miss
    assert _cached(server.url, key, prompt, "tenant-1") >= full_blocks - BLOCK_SIZE > 0
    assert _cached(server.url, key, prompt, "tenant-2") == 0  # other salt: no sharing
    assert _cached(server.url, key, prompt) == 0  # no salt is a tenant of its own
    assert _cached(server.url, key, prompt, "tenant-2") > 0  # but tenant-2 now has it


def test_api_keys_are_tenants(server) -> None:
    prompt = _prompt(2)
    alpha, beta = API_KEYS
    assert _cached(server.url, alpha, prompt) == 0
    assert _cached(server.url, alpha, prompt) > 0
    assert _cached(server.url, beta, prompt) == 0  # another key never sees alpha's KV
    assert _cached(server.url, beta, prompt) > 0
    # The body salt is scoped by the key: the same salt under two keys is two tenants.
    prompt = _prompt(3)
    assert _cached(server.url, alpha, prompt, "shared-name") == 0
    assert _cached(server.url, beta, prompt, "shared-name") == 0
    assert _cached(server.url, alpha, prompt, "shared-name") > 0
