

import os as _os

# the README's main job, the config the CLIs and benchmarks default to
DEFAULT_CONFIG = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))),
                               'configs', 'default.py')
