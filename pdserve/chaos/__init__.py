"""Fault injection against a real local cluster: ``pdserve chaos`` and the integration tests
run the same scenarios (pdserve.chaos.scenarios). Each scenario starts its own cluster of
real processes, injects one fault (kill -9, SIGSTOP, a network partition or delay through a
TCP proxy, a Redis restart, KV corruption, a shutdown), and checks what the client saw, that
no KV block is left stranded (``pdserve_kv_blocks_stranded`` back to 0) and that greedy
outputs are unchanged."""
