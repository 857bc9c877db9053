"""The KV-aware router: an index that recomputes every published block hash from the engines'
KV events (`index.py`), routing by longest cached prefix within a load cap, and its HTTP
service (`service.py`). It consumes `speckv.events`; engines never import it."""
