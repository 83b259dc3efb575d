"""Trajectory Balance with Asynchrony (TBA, Bartoldson et al.) on Ray: `make gfn` with gfn.mode=async.

Who does what (docs/async.md):
- searcher actors (gfn.searchers of them): each holds its own copy of the policy (HF generate, or
  a vLLM engine and no transformers copy) and the PRM scorer, or with gfn.scorer_actors > 0 no PRM;
  round after round it samples questions_per_step questions of its own share of the training
  problems (searcher_share: the shares are disjoint) x samples_per_question (S) solutions
  with the newest weights it has (at most gfn.searcher_rounds_per_version rounds per version),
  scores them (itself, or through a scorer actor) and sends them, tagged with that weights
  version, to the store;
- scorer actors (gfn.scorer_actors of them, default none): each holds the PRM and scores the rounds
  searchers send it (PooledScorer: a round to one actor, the actors in turn);
- the store actor: TBA's buffer (pipeline.finetune.tba.grouped_replay): a question's newest
  gfn.buffer_per_question completions kept, gfn.buffer_size in all (FIFO), drawn as B questions x K
  distinct completions, a question's group from the newest weights' completions with probability m;
  it drops completions of weights older than gfn.max_staleness trainer steps;
- the weights actor: the newest published weights version (with the object store, the
  references of its buckets; with gfn.weight_transport=collective the buckets go over one NCCL
  or gloo group of the trainer and every searcher: pipeline.finetune.tba.publication), a stop flag,
  and the reference to the training problems every searcher starts from;
- the trainer (this process, or every process of an accelerate group, of which only the main one
  talks to Ray and hands the others their share of each batch): the same training base,
  objective and update as the synchronous mode, on batches drawn from the store, re-scored under
  the current policy (and under the reference, which the trainer holds: a reset takes effect at
  once); every gfn.sync_every steps it publishes its weights in the sampler's dtype, in the
  background.

Only off-policy objectives (SubTB, TB, TB-VarGrad) may train on trajectories from older
policies; PPO in this mode is refused before anything starts. Trajectories travel between
processes as JSON text, weights as byte buckets (object store or collective). A searcher that dies is
restarted by Ray (up to gfn.searcher_max_restarts times) and rejoins: what it starts from (the
training problems) is an object the trainer put in Ray's object store once and holds for the
whole run, so a restart finds it whenever the death happens. A trainer that dies resumes from its
checkpoint, which holds the buffer (it is persisted, not refilled). Ray is an optional extra: it
is imported inside the functions that need it.

Modules, one idea each: settings (the gfn keys' checks before Ray starts, each searcher's share and
seed), cores (pinning a process to cores), stores (the weights and store actors), searcher (the
searcher actor), scorers (the PRM scorer actors), drawing (the trainer's batch requests to the
store), trainer (AsyncFinetuneTrainer); grouped_replay (the buffer), ray_cluster (joining the
cluster, placement), publication, weight_buckets and weight_transport (the weights to every
searcher at once).
"""
