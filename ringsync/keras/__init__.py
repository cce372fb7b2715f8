"""`import ringsync.keras as hvd` is `import ringsync.tensorflow.keras as hvd` (Horovod has
both names too): this package makes the two names one module, so its callbacks and
optimizer classes are the same objects under either name."""
import sys

import ringsync.tensorflow.keras as _keras

sys.modules["ringsync.keras.callbacks"] = _keras.callbacks
sys.modules["ringsync.keras.elastic"] = _keras.elastic
sys.modules[__name__] = _keras
