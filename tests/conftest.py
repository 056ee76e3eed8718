"""Suite-wide settings.

Property tests are derandomized by default so a CI run is reproducible: the same examples
every time. Explore new ones with ``HYPOTHESIS_PROFILE=explore make test``.
"""

import os

from hypothesis import settings

settings.register_profile("default", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, max_examples=500, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
