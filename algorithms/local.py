"""Local (Standalone): every client trains alone on its own data, nothing is exchanged.

The lower bound every personalised-FL paper reports. Nothing goes down or up, so communication is
zero; accuracy is each client's own model on its own test split.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedray.platform.api import (
    AlgorithmConfig,
    ClientModule,
    Server,
    register,
)


class LocalClient(ClientModule):
    def upload(self):
        return {}


@register("local", server=Server, client=LocalClient)
@dataclass
class LocalConfig(AlgorithmConfig):
    pass
