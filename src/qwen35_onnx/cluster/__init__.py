"""``qwen35-onnx serve --replicas N``: the server as a Ray Serve application of N chat replicas
behind one ingress, with conversation-aware routing (the optional 'cluster' extra: Ray Serve).

Layering: this package imports the server and the pipeline, never the reverse; Ray is imported
only by the modules that need it (:mod:`.conversations` and :mod:`.options` work without it).
"""

from .app import application, build_app, serve_cluster
from .options import ClusterOptions, Routing

__all__ = ["ClusterOptions", "Routing", "application", "build_app", "serve_cluster"]
