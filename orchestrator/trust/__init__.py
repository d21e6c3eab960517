"""The run's one trust boundary: every port a run opens admits only holders of the run's secret.

The threat model (docs/security.md): other users on the same host, other hosts on the same network, and a
process that knows the run's id but not its secret. Against them:

- ``secret``: the run's secret (generated per launch, handed to agents and workers in their environment only,
  never written to the run dir, logs, plan or manifests) and the MACs made with it.
- ``handshake``: a challenge-response in both directions over any stream socket. The client proves it holds
  the secret, the server proves it too, and the secret never travels: a fake server learns nothing.
- ``gate``: a listening socket that admits a connection only after the handshake, then hands it to the
  handler of the route the client named; bounded (connections, pending handshakes, handshake time) and
  self-healing (an accept error such as EMFILE is logged, backed off and survived).
- ``relay``: a loopback listener for clients orch cannot teach the handshake (torch's own TCPStore client,
  in torchrun and in the workers): it admits only processes of its own process tree (``peers``) and dials
  the gate with the handshake on their behalf.

This is authentication, not encryption: after the handshake the bytes travel as the protocol sends them (keep
the job on a private network, as torch's own documentation asks).
"""
