"""Direct transfer of a request's KV (target and draft) from a prefill engine to a decode
engine over NIXL, the transport vLLM's NixlConnector uses.

| module           | owns |
|------------------|------|
| `params.py`      | the `kv_transfer_params` schema, the hash contract, `ParamsError` by field |
| `layout_desc.py` | an engine's paged-KV description for a peer; the peer layout check |
| `lease.py`       | the prefill side's lease table (blocks kept for a decode engine) |
| `side_channel.py`| the ZeroMQ handshake / admit / heartbeat / release service and client |
| `transport.py`   | the NIXL agent, registered KV, block READs, notifications |
| `config.py`      | `NixlConfig`: the `--kv-transfer-config` JSON |
| `trust.py`       | which prefill engines a decode engine contacts (`kv_peers`, signed params) |
| `pulls.py`       | the decode side: peer links, admissions on threads, control messages |
| `connector.py`   | `NixlConnector`: the prefill side (leases) and the decode side (pulls) |
"""
