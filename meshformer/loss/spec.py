"""Former path of `meshformer.loss.token_loss`
(renamed: docs/design.md#words); warns once, for two releases."""

import sys

from meshformer.renamed import moved

sys.modules[__name__] = moved(__name__)
