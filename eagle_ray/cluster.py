"""What the job and the CLI need to know about the Ray cluster they run on (no pool logic).

Ray 2.60 clusters authenticate clients with a token (`RAY_AUTH_MODE=token`, `~/.ray/auth_token`).
A cluster started without it accepts anyone who can reach its ports and lets them run code; the
pool's replicas and the router would be theirs to call. So the long-lived pool refuses such a
cluster unless told otherwise (`eagle-ray serve --allow-insecure`).
"""

from __future__ import annotations

import ray


def connect(address: str, namespace: str) -> None:
    """Join a running cluster in `namespace` (the pool's placement groups are named there)."""
    ray.init(address=address, namespace=namespace, log_to_driver=False)


@ray.remote(num_cpus=0)
def _auth_mode_on_cluster() -> str:
    from eagle_ray.ray_compat import token_auth_enabled

    return "token" if token_auth_enabled() else "disabled"


def cluster_auth_mode(timeout_s: float = 60.0) -> str:
    """`"token"` or `"disabled"`: how the cluster's own processes authenticate (asked of a worker
    on the cluster, not of this client, which may hold a token the cluster ignores)."""
    return ray.get(_auth_mode_on_cluster.remote(), timeout=timeout_s)


def require_authenticated_cluster(allow_insecure: bool) -> None:
    """Refuse a cluster without token authentication unless `allow_insecure`."""
    if cluster_auth_mode() == "token" or allow_insecure:
        return
    raise PermissionError(
        "this Ray cluster runs without token authentication: anyone who can reach it could call "
        "the pool's replicas and router. Start it with token authentication (`ray "
        "get-auth-token --generate`, then `RAY_AUTH_MODE=token ray start --head` on every "
        "node), or pass --allow-insecure to serve anyway.")
