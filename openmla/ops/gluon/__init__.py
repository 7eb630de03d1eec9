"""The Hopper (sm90) tier: Gluon kernels behind ``mla_decode`` (:mod:`.decode`, :mod:`.decode_seesaw`,
:mod:`.decode_tiles`) and ``flash_attn_varlen`` (:mod:`.prefill`); :mod:`._lang` imports the Gluon names once
(``GLUON_AVAILABLE`` is False without ``triton.experimental.gluon``). ``docs/kernels.md`` has the design."""
