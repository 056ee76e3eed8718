"""A real rate-limited link on one box: network namespaces, tc, a two-node Ray cluster (docs/network.md)."""
