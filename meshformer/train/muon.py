"""Former path of `meshformer.optim.muon`
(moved to the optimizer registry: docs/design.md#words); warns once, for two releases."""

import sys

from meshformer.renamed import moved

sys.modules[__name__] = moved(__name__)
