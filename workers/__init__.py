"""The worker side of the deployment: engines, models, weights and the processes that serve them.

Importing it names where inductor keeps its cache, unless the user did (TORCHINDUCTOR_CACHE_DIR):
torch makes that directory as soon as torch._dynamo is imported (transformers imports it), in
/tmp/torchinductor_<user> when nothing is named, and a deployment must leave nothing in /tmp. A
compile moves it to its CPU level's directory (workers.engine.compile_cache.use_cache_dir)."""

import os as _os

from workers.files import inductor_default as _inductor_default

_os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_inductor_default()))
