"""Former path of `meshformer.checkpointing.conversion_progress`
(renamed: docs/design.md#words); warns once, for two releases."""

import sys

from meshformer.renamed import moved

sys.modules[__name__] = moved(__name__)
