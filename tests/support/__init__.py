"""Helpers the tests share: models and references, routers and workers, batch runs. Test modules
import from here, never from each other."""
