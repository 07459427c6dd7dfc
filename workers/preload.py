"""What a launcher's fork server (fusion.launcher) imports once, for every worker it forks: the
worker, the model loaders, and the tokenizers it holds (workers.weights.held_tokenizers), with the
collector paused (workers.gc_pause)."""

from workers.gc_pause import import_paused

import_paused("workers.worker", "workers.models", "workers.weights.held_tokenizers")
