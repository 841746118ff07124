"""Weight distribution: learner -> weight store -> master relay -> relay chain -> rollouts.

Import the submodules directly (none is imported here, so `import laminar_jax.weights` stays
cheap): `chain` (pure chain plan and time model), `flat` (pure numpy engine-layout buffer, index
and chunk checksums), `events` (event sink), `publish` (orbax async publisher and weight store;
jax), `master` (checkpoint -> chunks), `relay` (the RelayWorker actor and `pull`), `relay_group`
(placement, chain wiring, failover; Ray), `stream` (relay-to-relay TCP streams), `relay_state`
(what a relay holds), `relay_links` (its downstream links).
"""
