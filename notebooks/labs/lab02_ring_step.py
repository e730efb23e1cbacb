"""Lab 2: one step of the virtual ring.

Notebook 03 (the ring) is the background; ``ringattn_ref/ring.py`` is the full simulation (do not
call its ``send_to_next``, ``swap_buffers``, ``hop_kv`` or ``ring_forward``: that is the answer).
Ring Attention (arXiv:2310.01889, Algorithm 1) on ``N`` virtual hosts: host ``my_idx`` keeps its
query shard; the K/V shards travel around the ring, host ``i -> i + 1``. Write ``ring_step``: what
all hosts do at ring step ``step``:

1. post the sends first (on hardware they overlap this step's compute): every host puts the message
   it holds (``host.held``: a K/V shard and its number) into the receive buffer of host
   ``(my_idx + 1) % N`` -- except at the last step (``step == N - 1``), where nothing is left to send;
2. every host attends its queries to the K/V shard it holds, folding it into its running
   ``(host.m, host.l, host.o)`` with ``ringattn_ref.blockwise.attend_kv_shard`` (it updates the
   state in place; the shard needs the bias block of its keys for the host's queries,
   ``ringattn_ref.blockwise.bias_tile(problem.bias, qs.pos, kv.pos)``) -- unless the mask proves the
   whole hop empty (``ringattn_ref.masks.tile_is_empty`` on the host's query positions and the shard's
   key positions and segment ids): then the host skips the hop;
3. after the compute, unless it was the last step, every host swaps its buffers: the received message
   becomes the held one and the receive buffer is emptied (``None``).

So at step ``s`` host ``i`` holds K/V shard ``(i - s) % N`` (the authors' index arithmetic: with 4
hosts, at step 1 host 0 holds K/V shard 3). Return one bool per host: True if it computed the hop,
False if it skipped it.

The objects (``ringattn_ref.ring``, ``ringattn_ref.shards``): ``hosts[i]`` is a ``Host`` with
``my_idx``, ``qs`` (a ``QShard``: ``q`` [b, c, h, d], ``pos`` int [1, c] true positions, ``seg``
[b, c] or None), ``held`` and ``recv`` (a ``Message`` or None), and the state ``m``, ``l`` [b, h, c],
``o`` [b, c, h, d]. A ``Message`` has ``kv_idx`` and ``kv`` (a ``KVShard``: ``k``, ``v`` [b, c, hk, d],
``pos`` [1, c], ``seg`` [b, c] or None, ``bias`` None). ``problem`` is a ``RingProblem``: ``n_hosts``,
``hop`` (a ``HopConfig``: ``scale``, ``causal``, ``window``, ``block_q``, ``block_kv``), ``bias`` (the
full bias in true order, or None). Send the message object itself (a real ring sends the buffer; the
simulation passes a reference).

Grade: ``python notebooks/labs/grade.py lab02 your_file.py``. The grader builds the hosts with
``ringattn_ref.ring.setup_ring`` for fixed problems (5 hosts causal contiguous with empty hops and
rows that see nothing, 8 hosts striped, 3 hosts zigzag with a window and documents; GQA, b, d > 1)
and drawn ones (every layout, masks, 1 to 6 hosts), calls your ``ring_step`` for ``step = 0 .. N-1``
and checks after every step: one bool per host; who holds which shard, nothing left in a receive
buffer, no send after the last step; a hop is computed exactly when its mask is not provably empty;
each host's state is the float64 oracle's over the shards it has seen so far (to 1e-12). Only
``attend_kv_shard``, ``bias_tile``, ``ringattn_ref.masks``, ``ringattn_ref.shards`` and the classes of
``ringattn_ref.ring`` may be called.
"""


def ring_step(hosts, step, problem):
    """Run ring step ``step`` on every host of ``hosts`` (a list of ``ringattn_ref.ring.Host``).

    problem: a ``ringattn_ref.ring.RingProblem``. Updates the hosts in place; returns a list of
    ``len(hosts)`` bools, True where the host computed its hop.
    """
    raise NotImplementedError("lab02: write ring_step (see the docstring)")
