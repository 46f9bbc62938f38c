/*
 * checkpointq write-behind protocol, v2 (notes/protocol-v2.md), as a Spin model.
 * Scope, invariants and how to run: tests/model/README.md. Runner: scripts/check-model.
 *
 * One step of a process here is one atomic thing in the real system: one Lua script (a
 * Redis script runs alone), one read, or one local decision. Everything between two steps
 * can interleave with every other process, and Spin explores every interleaving.
 *
 * Units: time is a tick (`now`, the servers' clock, which the brokers, the store and the
 * workers agree on). A seq is tick * K + counter: the producer rule's microseconds, with
 * K seq units per tick, so a fence + 1 is still in the fence's tick (K > NREQ keeps it so).
 *
 * Broken variants, each a -D macro (see README.md, "Broken variants"):
 *   SETTLE_BY_SEQ            settle removes every entry with seq <= the settled one's (v1)
 *   NO_PUBLISH_CLOCK_CHECK   publish.lua does not check the clock or seq against N
 *   PROCESS_FLOOR            one stamp floor for all sessions of a producer (v1 SeqClock)
 *   SHORT_TOMBSTONE          a tombstone expires SHORT_TOMB ticks after the delete applied
 *   NO_LIFETIME              no lapse: a save applies whatever its age, TTL from the apply
 *   GLOBAL_IDS               staged values and refusal records keyed by request id only
 *   STORE_FIRST_LOAD         a two-step load reads the store first, then the broker
 *   LOAD_DEADLINE_AT_BROKER_READ  a pending save's deadline judged at the broker read
 *   (with PROCESS_FLOOR and OK_TWO_SESSIONS for hole 1)
 *   NO_RECORD_COUNTS         loads do not compare a session's entries with its count
 *   SWEEP_QUEUE_ONLY         the sweep takes a message in unacked for gone
 *   NO_MARK                  producers compare epochs only, not marks (before issue 44)
 *   MARK_WITHOUT_TOKEN       producers compare marks only, not their tokens (before the
 *                            ring of tokens: finding 7)
 *   SETTLE_ANY_MISSING       a settle whose entry is missing counts one less whenever the
 *                            count expects a missing entry, whoever's (before the counted
 *                            requests: finding 6)
 *   SETTLE_ANY_DELIVERY      a settle of a delivery from before its request's republish
 *                            removes the republished entry and value (before the delivery
 *                            tags: finding 5)
 * The broker's faults of issue 44 (README.md, "The broker's faults"), each a -D macro:
 *   SUFFIX_LOSS              the loss may also be of a suffix (the broker goes back in time)
 *   WINDOW=w                 producers detect a loss (epoch, mark) and publish again their
 *                            accepted requests of the last w ticks (the recovery window)
 *   DETECT                   producers detect (and count) a loss, without a window
 *   RECORD_LOSS              one pending entry lost without its message (counts, refusal)
 *   PURGE                    one purge of the queue; the sweep settles orphans as lost
 * Scope knobs: NREQ and the cast Q_OK, Q_AHEAD, Q_SLOW, Q_FAST, Q_EVIL, Q_OTHER; OK_STAGED_ONLY,
 * OK_TWO_SESSIONS, TTL, TMAX, NW, LOSSES, CRASHES (README.md, "Scope"). Explorations beyond
 * the spec: HIJACK_SAME_SESSION, STRICT_FENCE (README.md, "Findings").
 *
 * Where each part is in the code:
 *   producer stamps        tasks/producer/clock.py (SeqClock; v2: per-session floors only)
 *   publish                tasks/lua/publish.lua (v2: the checks against the broker's clock)
 *   loads                  tasks/lua/load_pending.lua, read_pending.lua; store/lua/load.lua;
 *                          the clients' merge (tasks/producer/pending.py, clients/go)
 *   worker                 tasks/checkpoints.py, worker/coalesce.py; the ahead check
 *                          tasks/seq.py; the lifetime store/ordering.py (lapsed, deadline_ms)
 *   store writes           store/lua/save.lua, store/lua/delete.lua (ARGV[5] '2': a lapse)
 *   settle                 tasks/lua/settle.lua (v2: HDEL of the request's own entry)
 *   wait_durable           tasks/producer/outcomes.py
 *   detection, window      tasks/producer/pending.py (EpochWatch, RecentPublishes, recover);
 *                          clients/go/pending.go (epochs), recent.go
 *   sweep of orphans       tasks/orphans.py
 */

#ifdef WINDOW
#define DETECT
#endif
#ifdef NO_MARK
#define MARK_WITHOUT_TOKEN  /* before issue 44: no mark, so no token either */
#endif
#ifdef NO_RECORD_COUNTS
#define RECORD_LOSS
#endif
#ifdef SWEEP_QUEUE_ONLY
#define PURGE
#endif
#if defined(RECORD_LOSS) && !defined(SETTLE_ANY_MISSING)
#define COUNTED_IDS     /* settle.lua's rule: the counted requests behind the count */
#endif

#ifndef NREQ
#define NREQ 3          /* requests in a run (saves and deletes, refused ones included) */
#endif
#ifndef NW
#define NW 1            /* workers */
#endif
#ifndef TMAX
#define TMAX 5          /* the last tick */
#endif
#ifndef LOSSES
#define LOSSES 1        /* losses of the broker's data */
#endif
#define NS 2            /* sessions 1 .. NS */
#ifndef Q_OTHER
#define Q_OTHER 0
#endif
#if Q_OTHER > 0
#define NP 6            /* producers (replicas): P_OTHER too */
#else
#define NP 5            /* producers (replicas) */
#endif
#define K 4             /* seq units per tick */
#ifndef TTL
#define TTL 3           /* session lifetime, ticks */
#endif
#define L 2             /* max seq ahead, ticks (the clock check allows L/2) */
#define TOMB 1          /* tombstone margin, ticks */
#define SHORT_TOMB 1    /* SHORT_TOMBSTONE: a tombstone's fixed lifetime, ticks */
#define R 8             /* request ids are 1 .. R-1 */
#define NSL (NREQ + 1)  /* request slots 1 .. NREQ (0 = none) */
#define NSS (NS + 1)

#define SAVE 0
#define DEL 1
/* the order key k(r) = (seq, rank(op), req) as one integer: compare keys with < */
#define KEY(seq, op, rq) ((seq) * 2 * R + (op) * R + (rq))
#define SEQ_OF(k) ((k) / (2 * R))
#define REQ_OF(k) ((k) % R)

/* producers: their clock skews (ticks) are set in init */
#define P_OK   0        /* a correct replica, skew 0 */
#define P_FAST 1        /* clock ahead beyond L/2: every publish of its own is refused */
#define P_SLOW 2        /* clock behind by TTL: its blind stamps are already lapsed */
#define P_EVIL 3        /* clock ahead within L/2; sends bad input, reuses others' ids */
#define P_AHEAD 4       /* clock ahead within L/2, a correct replica otherwise */
#define P_OTHER 5       /* a correct replica on another session (unaware of P_OK's marks) */
#define FAST_FAULT(p) (skew[p] > L / 2)      /* its clock is ahead beyond the limit */
#define SLOW_FAULT(p) (skew[p] <= -TTL)      /* its clock is a TTL behind or more */

/* st[i]: the request in slot i */
#define FREE 0
#define RESERVED 1      /* a producer is preparing it (stamp not yet taken) */
#define REFUSED_PUB 2   /* publish.lua refused it: nothing written */
#define ACCEPTED 3
/* msg[i]: its message on the broker */
#define NOMSG 0
#define QUEUED 1
#define UNACKED 2
#define ACKED 3
#define LOST 4          /* lost with the broker's data */
#define PURGED 5        /* deleted from the queue by a purge (its record stays) */

byte now;               /* the servers' clock, ticks */
byte nreq;              /* slots handed out */
byte losses;            /* the pending epoch changes with each */
short skew[NP];

/* requests: fixed once published */
byte r_p[NSL], r_s[NSL], r_op[NSL], r_rq[NSL], r_seq[NSL], r_dl[NSL];
bit r_stg[NSL], r_bad[NSL];
short r_key[NSL];
/* and what became of them (the model's ground truth, not protocol state) */
byte st[NSL], msg[NSL];
bit applied[NSL];       /* a worker's save.lua/delete.lua applied it (step 3) */
bit hit[NSL];           /* it set the fence: applied, or lapsed over the fence (step 2) */
bit refused[NSL];       /* dead-lettered / refused by a worker */
bit own[NSL];           /* ... for its own producer's fault */
bit exempt[NSL];        /* lost with the broker's data before it was applied */

/* broker: entry hash E[s] (req -> (seq, op)), staged values V[s, req], their expiry.
 * Indexed by key slot: the slot of the first request with that (session, req) key
 * (KSE/KSV below), so two requests sharing a key share one entry, as in Redis. */
bit e_on[NSL];
byte e_slot[NSL];       /* the request whose (seq, op) the entry holds */
bit v_on[NSL];
byte v_slot[NSL];       /* whose value it is */

/* store: per session the fence (key, lapsed, expiry) and the value (whose, deadline);
 * refusal records keyed like staged values */
short f_key[NSS];       /* 0: no fence */
bit f_lap[NSS];
byte f_exp[NSS];
byte val[NSS];          /* 0: no value */
byte val_dl[NSS];
bit rr[NSL];

/* producers: the per-session floor F_p[s] */
byte F[NP * NSS];
/* workers: the message each holds (0: none) */
byte wcur[NW];
/* producers mid-request; whether the fast one made its request (it makes one: all of them
 * are refused at publish) */
bit mid[NP];
byte used[NP];          /* requests made so far, per producer */
byte crashes;

#ifdef DETECT
/* broker: publish.lua's mark (a counter every publish advances) and epoch (0: none, as after
 * a loss of everything; a fresh token from ntok otherwise) */
byte mark, epoch, ntok;
byte r_mk[NSL];         /* the mark of the request's latest publish */
byte r_at[NSL];         /* the tick of its publish: its age in the recovery window */
/* publish.lua's ring of the marks' tokens (the pending mark's fields 't<mark mod 65536>'):
 * rt[m], the token of mark m's publish, 0 when its slot holds no mark m (never written, or
 * its write undone with the broker's data; marks here never wrap). Each publish's token is
 * fresh and random; all that is ever compared is two tokens of one mark, and a slot is
 * written once between two losses of the broker's data (the mark only grows between them),
 * so the token is the era of its write: TOKEN, one more than the losses so far. */
#define MMAX (2 * NREQ + 2)
#define TOKEN (losses + 1)
byte rt[MMAX];
/* producers (EpochWatch / epochs): the epoch seen (0 none, LOSTE after a loss), the highest
 * mark seen in it and its token, a mark seen before the broker went back below it (or gave
 * it again) and not yet reported, and its token; whether it counted a loss */
#define LOSTE 255
byte pe[NP], pm[NP], pu[NP], ptk[NP], putk[NP];
bit lc[NP];
#endif
#ifdef LAST_LOAD
bit lastload;           /* P_OK made its last call, a load (finding 7's aware client) */
#endif
#ifdef WINDOW
bit wst[NW];            /* the worker holds a delivery from before its request's latest
                         * publish (a republish): its settle is not the records' (the
                         * counted field names another delivery tag: settle.lua) */
#define FRESH(w) wst[w] = 0
#else
#define FRESH(w) skip
#endif
#ifdef RECORD_LOSS
byte cnt[NSS];          /* publish.lua's pending counts: entries written and not settled */
byte idx[NSS];          /* the pending index: the latest deadline published (0: none) */
bit rlost;              /* the one entry lost without its message happened */
#ifdef COUNTED_IDS
bit elost[NSL];         /* counted, its entry lost: its field in pending-counted, whose removal
                         * (its own settle, once) spends the count; it goes with the broker's
                         * data, the undoing of its publish and the count's expiry */
#endif
#endif
#ifdef PURGE
bit purged;             /* the one purge happened */
bit lostrec[NSL];       /* the sweep settled it as lost (a refusal record of kind lost) */
#define PURGED_ON(q) (msg[q] == PURGED && ENTRY_OF(q))
#else
#define PURGED_ON(q) false
#endif
/* a request's own entry is on the broker (a load may serve it, by design) */
#define ENTRY_OF(q) (e_on[KSE(q)] && e_slot[KSE(q)] == (q))
/* which requests an answer may come from besides those that count: one purged whose entry
 * the sweep has not settled yet */
#define SERVABLE(q) PURGED_ON(q)

#ifdef HIJACK_SAME_SESSION
#define HIJACK_SAME true
#else
#define HIJACK_SAME false
#endif

/* entries: keyed by (session, req) */
#define KSE(i) ((r_s[r_rq[i]] == r_s[i]) -> r_rq[i] : i)
#ifdef GLOBAL_IDS
/* hole 5 (v1): a staged value and a refusal record are keyed by the request id alone */
#define KSV(i) (r_rq[i])
#else
#define KSV(i) KSE(i)
#endif

/* scratch for d_steps (not in the state vector: always written first, and only ever used
 * inside one d_step, never across an atomic's steps, which Spin may backtrack into) */
hidden byte hq, hw, hm, hs, ht, hc;
hidden byte hv;
hidden short hk, hseq, hcp;
hidden byte hok, hquiet;
hidden byte hd, hse, hsm, hb, hr, hn, htk, hfk;
/* one per assertion, so that a violation names its invariant */
hidden byte a_value_ok, a_no_lost_write, b_deletes_stick, d_publish_refusal, d_worker_refusal, d_applied_true, d_refused_true, c_final_state;
hidden byte e_detected, d_lost_true;

/* ------------------------------------------------------------------------------------ */
/* Loads (tasks/lua/load_pending.lua, store/lua/load.lua, the client's merge)            */

/* The merge: the max entry if it is ordered after the fence (its value, "absent" if a
 * delete or past its deadline), else the store's answer. ak, ac: the answer's key and value;
 * at: when the value was judged live. */
#define DL_OF(k) (SEQ_OF(k) / K + TTL)
#ifdef LOAD_DEADLINE_AT_BROKER_READ
/* the spec read literally as load_pending.lua would do it: the deadline judged at the
 * broker read, by the broker's TIME */
#define LIVE_AT_BROKER_READ(m) (now < r_dl[m])
#define MERGE(bk, bc, sk, sc, tb, ts, ak, ac, at) \
  if :: bk > sk -> ak = bk; ac = bc; at = tb :: else -> ak = sk; ac = sc; at = ts fi
#else
#define LIVE_AT_BROKER_READ(m) true
#define MERGE(bk, bc, sk, sc, tb, ts, ak, ac, at) \
  if :: bk > sk -> ak = bk; ac = ((now < DL_OF(bk)) -> bc : 0); at = now \
     :: else -> ak = sk; ac = sc; at = ts fi
#endif

/* read_pending.lua's 'missing': fewer entries left in E[s] than its count says (one lost
 * without its message): the load refuses (bk = -1), never serving the store's older answer. */
#if defined(RECORD_LOSS) && !defined(NO_RECORD_COUNTS)
#define MISSING(s, bk, bc) \
  hn = 0; \
  for (hq : 1 .. NREQ) { if :: e_on[hq] && r_s[e_slot[hq]] == s -> hn++ :: else fi }; \
  if :: idx[s] > now && cnt[s] > hn -> bk = -1; bc = 0 :: else fi; \
  hq = 0
#else
#define MISSING(s, bk, bc) skip
#endif

/* The broker's half: the max entry m of E[s] by key, and its value if a save (V[s, m.req]).
 * bk = 0: no entry. Whether m is past its deadline is judged when the two halves merge, by
 * the server clock at the store read (see MERGE below). */
inline broker_read(s, bk, bc) {
  bk = 0; bc = 0; hm = 0;
  for (hq : 1 .. NREQ) {
    if
    :: e_on[hq] && r_s[e_slot[hq]] == s && r_key[e_slot[hq]] > bk ->
       bk = r_key[e_slot[hq]]; hm = e_slot[hq]
    :: else
    fi
  }
  if
  :: bk != 0 && r_op[hm] == SAVE && LIVE_AT_BROKER_READ(hm) && v_on[KSV(hm)] -> bc = v_slot[KSV(hm)]
  :: else -> bc = 0
  fi;
  MISSING(s, bk, bc)
}





/* The store's half: the fence's key, and the value unless past its deadline. */
inline store_read(s, sk, sc) {
  sk = f_key[s];
  sc = ((val[s] != 0 && now < val_dl[s]) -> val[s] : 0)
}

/* Which requests the invariants protect: all, but with HIJACK_SAME_SESSION (exploring a
 * faulty producer reusing an id on the victim's own session) not the reusing request
 * itself, whose own fault loses or misreports it: (d) asks only that the victim be safe. */
#ifdef HIJACK_SAME_SESSION
#define PROTECTED(q) (r_rq[q] == q)
#else
#define PROTECTED(q) true
#endif

/* Whether request q counts as the answer of a load: accepted, not refused for its own
 * fault, not lost with the broker's data before it was applied. */
#define COUNTS(q) (st[q] == ACCEPTED && !own[q] && (!exempt[q] || hit[q]))

#ifdef DETECT
#define ED true
#define LOSS_COUNTED(p) lc[p]
#else
#define ED false
#define LOSS_COUNTED(p) false
#endif

/* Invariants (a) and (b) for one load of session s that answered key ak with value ac
 * (0: absent), the value judged live at tick at; mask: the requests accepted when it
 * started; cmask: those that counted then (a request lost or refused while the load ran
 * may still be its answer: it was pending when the load read the broker). */
inline check_load(s, ak, ac, at, mask, cmask, xmask, who) {
  /* a value answer is the value of the request the load names, of this session, live */
  if
  :: ac != 0 ->
     hok = (r_s[ac] == s && r_op[ac] == SAVE && r_key[ac] == ak && at < r_dl[ac]);
     if :: !hok -> printf("VIOLATION (a): a load of s%d served #%d's value, not the live value of the request it names (seq %d req %d)\n", s, ac, SEQ_OF(ak), REQ_OF(ak)) :: else fi;
     a_value_ok = hok; assert(a_value_ok)      /* (a): a value served is the named request's own, not past deadline */
  :: else
  fi;
  for (hw : 1 .. NREQ) {
    if
    :: st[hw] == ACCEPTED && (mask & (1 << hw)) && r_s[hw] == s && !own[hw] && PROTECTED(hw) &&
       ((!exempt[hw] && !(xmask & (1 << hw))) || (ED && exempt[hw] && !hit[hw] && r_p[hw] == who)) ->
       if
       :: ac != 0 -> hok = (r_key[ac] >= r_key[hw])
       :: else ->
          /* absent: only as the answer of a delete, or of a save past its deadline,
           * ordered >= w (one that counts: not refused for its own fault, not lost) */
          hok = false;
          for (hq : 1 .. NREQ) {
            if
            :: (COUNTS(hq) || (cmask & (1 << hq)) || hq == hw || SERVABLE(hq)) && r_s[hq] == s &&
               r_key[hq] >= r_key[hw] && (r_op[hq] == DEL || r_dl[hq] <= now) -> hok = true
            :: else
            fi
          }
       fi;
       if
       :: !exempt[hw] ->
          if :: !hok -> printf("VIOLATION (a): a load of s%d answered seq %d req %d value #%d: accepted #%d (seq %d) is lost\n", s, SEQ_OF(ak), REQ_OF(ak), ac, hw, r_seq[hw]) :: else fi;
          a_no_lost_write = hok; assert(a_no_lost_write)    /* (a) no accepted write lost */
       :: else ->
          /* (e) a producer's load that misses one of its own accepted requests, lost with
           * the broker's data and not published again, is made by a producer that counted
           * a loss: the loss is detected, never silently stale */
          hok = hok || LOSS_COUNTED(who);
          if :: !hok -> printf("VIOLATION (e): P%d's load of s%d misses its own #%d, lost with the broker's data, and P%d counted no loss\n", who, s, hw, who) :: else fi;
          e_detected = hok; assert(e_detected)     /* (e) a loss of accepted requests is detected */
       fi
    :: else
    fi
  }
  if
  :: ac != 0 ->
     for (hw : 1 .. NREQ) {
       if
       :: st[hw] == ACCEPTED && (mask & (1 << hw)) && r_s[hw] == s && r_op[hw] == DEL &&
          !own[hw] && (!exempt[hw] || applied[hw]) ->
          hok = (r_key[ac] > r_key[hw]);
          if :: !hok -> printf("VIOLATION (b): a load of s%d served #%d's value, ordered before the delete #%d\n", s, ac, hw) :: else fi;
          b_deletes_stick = hok; assert(b_deletes_stick)  /* (b) deletes stick */
       :: else
       fi
     }
  :: else
  fi;
  hw = 0
}

/* ------------------------------------------------------------------------------------ */
/* Detection and recovery (pending.py EpochWatch, RecentPublishes; Go epochs, recent.go)  */

#ifdef NO_MARK
#define NO_MARK_CHECK true   /* before issue 44: only a changed epoch is a loss */
#else
#define NO_MARK_CHECK false
#endif
#ifdef MARK_WITHOUT_TOKEN
/* before the ring (finding 7): no token is written, sent or compared; the mark alone judges */
#define RING_WRITE(m) skip
#define TOKEN_AT(m) 0
#define FORKED(m, t) false
#else
#define RING_WRITE(m) rt[m] = TOKEN
#define TOKEN_AT(m) rt[m]
/* the ring's slot of mark m holds m with another token than t (t = 0: unknown, tells
 * nothing; a slot without m tells nothing either) */
#define FORKED(m, t) ((t) != 0 && rt[m] != 0 && rt[m] != (t))
#endif
#ifdef DETECT
/* EpochWatch.observe: one reply's epoch e, mark m (below: a mark under it shows the broker
 * went back in time) and m's token tk; fk: the reply says the broker holds the mark this
 * producer saw (pm) with another token (read_pending.lua's forked: a load's reply only).
 * hd: the reply shows a loss not counted before. */
inline observe(p, e, m, below, tk, fk) {
  hd = 0;
  if
  :: pe[p] == 0 || pe[p] == LOSTE ->
     if :: e != 0 -> pe[p] = e; pm[p] = m; ptk[p] = tk :: else fi
  :: else ->
     if
     :: e == pe[p] ->
        if
        :: !(fk) && (m >= below || NO_MARK_CHECK) ->
           if :: m > pm[p] || (m == pm[p] && ptk[p] == 0) -> pm[p] = m; ptk[p] = tk :: else fi
        :: (fk) && pu[p] != 0 -> skip     /* found already, not reported yet */
        :: else ->
           /* below the mark seen, or that mark with another token: lost (pm and its
            * token: the mark a load sent is the one seen) */
           if :: pm[p] > pu[p] -> pu[p] = pm[p]; putk[p] = ptk[p] :: else fi;
           pm[p] = m; ptk[p] = tk; hd = 1
        fi
     :: else ->
        /* turned by the report of a loss this producer found: counted already */
        hd = (pu[p] == 0);
        pe[p] = ((e == 0) -> LOSTE : e); pm[p] = m; ptk[p] = tk; pu[p] = 0; putk[p] = 0
     fi
  fi;
  if :: hd -> lc[p] = 1; printf("t%d P%d finds the broker lost accepted requests\n", now, p) :: else fi
}

/* publish.lua's mark and epoch for an accepted push of request i by p, and the reply: the
 * producer sends the epoch and the mark it saw with its token (the one it found lost and
 * did not report yet, else the highest); a mark now at or below it, or its slot holding it
 * with another token (read before this publish writes its own slot), means the broker went
 * back in time, and the epoch turns (for every client to see). */
inline push_mark(p, i) {
  hse = ((pe[p] == LOSTE) -> 0 : pe[p]);
  if :: pu[p] != 0 -> hsm = pu[p]; htk = putk[p] :: else -> hsm = pm[p]; htk = ptk[p] fi;
  hb = pm[p] + 1;
  mark++; r_mk[i] = mark;
  hfk = (epoch != 0 && epoch == hse && FORKED(hsm, htk));
  RING_WRITE(mark);
#ifdef MARK_WITHOUT_TOKEN
  printf("t%d   mark %d\n", now, mark);
#else
  printf("t%d   mark %d, token %d\n", now, mark, TOKEN_AT(mark));
#endif
  if
  :: epoch == 0 -> ntok++; epoch = ntok
  :: epoch != 0 && epoch == hse && (mark <= hsm || hfk) -> ntok++; epoch = ntok
  :: else
  fi;
  observe(p, epoch, mark, hb, TOKEN_AT(mark), false)
}
#endif

/* publish.lua's records for request i: its entry (a new one counted), a save's value */
inline push_records(i) {
  hq = KSE(i);
#ifdef COUNTED_IDS
  /* counted once: one counted already, its entry lost, is not counted again */
  if :: !e_on[hq] && !elost[i] -> cnt[r_s[i]]++ :: else fi;
  elost[i] = 0;
#elif defined(RECORD_LOSS)
  if :: !e_on[hq] -> cnt[r_s[i]]++ :: else fi;
#endif
#ifdef RECORD_LOSS
  if :: r_dl[i] > idx[r_s[i]] -> idx[r_s[i]] = r_dl[i] :: else fi;
#endif
  e_on[hq] = 1; e_slot[hq] = i;
  if
  :: r_op[i] == SAVE -> hq = KSV(i); v_on[hq] = 1; v_slot[hq] = i
  :: else
  fi
}

#ifdef WINDOW
/* recover: publish again, oldest first, p's accepted requests of the last WINDOW ticks
 * (each the same request: same id and stamp). One the broker refuses (past its deadline
 * now) is skipped. A republished request counts again: it is back on the broker. */
inline recover(p) {
  for (hr : 1 .. NREQ) {
    if
    :: r_p[hr] == p && st[hr] == ACCEPTED && r_at[hr] + WINDOW >= now ->
       printf("t%d P%d republishes ", now, p); say(hr);
       if
       :: r_dl[hr] <= now -> printf(" -> refused (past its deadline)\n")
       :: else ->
          printf(" -> accepted\n");
          if :: msg[hr] != QUEUED && msg[hr] != UNACKED -> msg[hr] = QUEUED :: else fi;
          /* back on the broker, it counts again; a worker still holding a delivery of
           * it from before the loss settles nothing of it (README.md, finding 5) */
          exempt[hr] = 0;
          if :: wcur[0] == hr -> wst[0] = 1 :: else fi;
          if :: NW > 1 && wcur[NW - 1] == hr -> wst[NW - 1] = 1 :: else fi;
          push_records(hr);
          push_mark(p, hr)
       fi
    :: else
    fi
  }
  hr = 0; hd = 0
}
#define RECOVER(p) if :: hd -> recover(p) :: else fi
#else
#define RECOVER(p) skip
#endif

/* for trails (spin -t): "#slot (session op seq req deadline)" */
inline say(i) {
  printf("#%d (s%d ", i, r_s[i]);
  if
  :: r_op[i] == SAVE && r_stg[i] -> printf("staged save")
  :: r_op[i] == SAVE && !r_stg[i] -> printf("save")
  :: else -> printf("delete")
  fi;
  printf(" seq %d req %d dl %d", r_seq[i], r_rq[i], r_dl[i]);
  if :: r_bad[i] -> printf(" BAD-INPUT)") :: else -> printf(")") fi
}

/* ------------------------------------------------------------------------------------ */
/* Producers (tasks/producer/clock.py SeqClock, client.py, tasks/lua/publish.lua)        */

/* The cast: how many requests each replica makes (Q_*), NREQ = their sum. What each makes:
 *   P_OK    session 1 (and 2 with OK_TWO_SESSIONS): a save, a staged save or a delete;
 *           blind, or after a load of the session
 *   P_AHEAD like P_OK (plain saves), with a clock ahead within the limit (L/2)
 *   P_SLOW  session 1: a save or a delete, blind or after a load; clock a TTL behind
 *   P_FAST  session 1: a blind save; clock ahead beyond the limit (refused at publish)
 *   P_EVIL  session 2: a blind save under the request id of an accepted request of session 1
 *           (read from its pending record), staged or with a bad input (HIJACK_SAME_SESSION:
 *           on session 1 too); clock ahead within the limit
 *   P_OTHER session 2: a blind save; a correct replica that reads nothing of session 1, so
 *           it sees only its own publishes' marks (finding 7: the unaware producer) */
#ifndef Q_OK
#define Q_OK 2
#endif
#ifndef Q_AHEAD
#define Q_AHEAD 0
#endif
#ifndef Q_SLOW
#define Q_SLOW 1
#endif
#ifndef Q_FAST
#define Q_FAST 0
#endif
#ifndef Q_EVIL
#define Q_EVIL 0
#endif
#if NREQ != Q_OK + Q_AHEAD + Q_SLOW + Q_FAST + Q_EVIL + Q_OTHER
#error "NREQ must be Q_OK + Q_AHEAD + Q_SLOW + Q_FAST + Q_EVIL + Q_OTHER"
#endif
#define QUOTA(p) ((p == P_OK) -> Q_OK : ((p == P_AHEAD) -> Q_AHEAD : ((p == P_SLOW) -> Q_SLOW : \
                  ((p == P_FAST) -> Q_FAST : ((p == P_EVIL) -> Q_EVIL : Q_OTHER)))))
#define VICTIM(j, s) ((j) < NREQ && st[j] == ACCEPTED && r_p[j] != P_EVIL && (r_s[j] != s || HIJACK_SAME))
#define ANY_VICTIM(s) (VICTIM(1, s) || VICTIM(2, s) || VICTIM(3, s) || VICTIM(4, s))
#ifdef HIJACK_SAME_SESSION
#define EVIL_CAN (ANY_VICTIM(1) || ANY_VICTIM(2))
#else
#define EVIL_CAN ANY_VICTIM(2)
#endif
#define MAY_REQUEST(p) (used[p] < QUOTA(p))
#define CAN_REQUEST(p) (MAY_REQUEST(p) && (p != P_EVIL || EVIL_CAN))
#define CAN_LOAD(p) (p == P_OK || p == P_AHEAD || p == P_SLOW)

inline choose_request(p, i) {
  r_p[i] = p; r_rq[i] = i;
  if
  :: p == P_OK ->
#ifdef OK_TWO_SESSIONS
     if :: r_s[i] = 1 :: r_s[i] = 2 fi;
#else
     r_s[i] = 1;
#endif
#ifdef OK_STAGED_ONLY
     if :: r_op[i] = SAVE; r_stg[i] = 1 :: r_op[i] = DEL fi
#else
     if :: r_op[i] = SAVE :: r_op[i] = SAVE; r_stg[i] = 1 :: r_op[i] = DEL fi
#endif
  :: p == P_FAST -> r_s[i] = 1; r_op[i] = SAVE
  :: p == P_OTHER -> r_s[i] = 2; r_op[i] = SAVE
  :: p == P_SLOW || p == P_AHEAD -> r_s[i] = 1; if :: r_op[i] = SAVE :: r_op[i] = DEL fi
  :: p == P_EVIL ->
#ifdef HIJACK_SAME_SESSION
     if :: ANY_VICTIM(1) -> r_s[i] = 1 :: ANY_VICTIM(2) -> r_s[i] = 2 fi;
#else
     r_s[i] = 2;
#endif
     r_op[i] = SAVE;
     if :: r_stg[i] = 1 :: r_bad[i] = 1 fi;
     if
     :: VICTIM(1, r_s[i]) -> r_rq[i] = r_rq[1]
     :: VICTIM(2, r_s[i]) -> r_rq[i] = r_rq[2]
     :: VICTIM(3, r_s[i]) -> r_rq[i] = r_rq[3]
     :: VICTIM(4, r_s[i]) -> r_rq[i] = r_rq[4]
     fi
  fi
}

/* stamp(s): seq = max(c_p, F_p[s] + 1); F_p[s] = seq. Then publish.lua, one script:
 * the checks against the broker's clock N first (nothing written when one refuses), then
 * LPUSH, the entry, the staged value, E[s]'s expiry. */
inline stamp_and_publish(p, i) {
  hs = r_s[i];
  hcp = now + skew[p];
  if :: hcp < 0 -> hcp = 0 :: else fi;       /* c_p, ticks */
  hseq = F[p * NSS + hs] + 1;
  if :: hcp * K > hseq -> hseq = hcp * K :: else fi;
#ifdef PROCESS_FLOOR
  /* v1: the process's last stamp and every fence it saw raise every session's stamps */
  for (hq : 1 .. NS) { F[p * NSS + hq] = hseq }
#else
  F[p * NSS + hs] = hseq;
#endif
  r_seq[i] = hseq; r_key[i] = KEY(hseq, r_op[i], r_rq[i]); r_dl[i] = hseq / K + TTL;
  /* hok: accepted; hc: refused for its own producer's fault */
  hok = true; hc = true;
#ifndef NO_PUBLISH_CLOCK_CHECK
  if :: hcp > now + L / 2 -> hok = false; hc = FAST_FAULT(p) :: else fi;          /* "clock ahead" */
  if :: hok && hseq > now * K + L * K -> hok = false; hc = FAST_FAULT(p) :: else fi; /* "seq too far ahead" */
#endif
  if :: hok && r_dl[i] <= now -> hok = false; hc = SLOW_FAULT(p) :: else fi;     /* "already lapsed" */
  printf("t%d P%d publish ", now, p); say(i);
  if
  :: !hok ->
     printf(" -> refused at publish\n");
     st[i] = REFUSED_PUB;
     /* nothing of it remains anywhere: forget it (fewer states) */
     r_p[i] = 0; r_s[i] = 0; r_op[i] = 0; r_rq[i] = 0; r_seq[i] = 0; r_dl[i] = 0;
     r_stg[i] = 0; r_bad[i] = 0; r_key[i] = 0;
     d_publish_refusal = hc;
     if :: !hc -> printf("VIOLATION (d): P%d refused at publish, not for its own clock\n", p) :: else fi;
     assert(d_publish_refusal)    /* (d): refused at publish only for its own clock */
  :: else ->
     printf(" -> accepted\n");
     st[i] = ACCEPTED; msg[i] = QUEUED;
     /* E[s] expires at the max deadline of its entries (see the clock) */
     /* every save's value goes to V[s, req] (a staged save's message carries none) */
     push_records(i);
#ifdef DETECT
     r_at[i] = now;
     push_mark(p, i);
     RECOVER(p)
#endif
  fi
}

/* publish.lua, then forget the floors of producers that will never stamp again (dead
 * values: fewer states) */
inline publish(p, i) {
  stamp_and_publish(p, i); i = 0; s = 0; mid[p] = 0;
  for (hq : 0 .. NP - 1) {
    if :: !mid[hq] && !MAY_REQUEST(hq) -> for (hw : 1 .. NS) { F[hq * NSS + hw] = 0 } :: else fi
  }
  hq = 0    /* (a d_step must not end in a loop: Spin 6.5 loses the exit label) */
}

proctype producer(byte p) {
  byte i, s, bc, t0, mask, cmask, xmask, sc;
  byte ph;   /* 0: idle; 1: the load read the broker; 2: it read the store, the write is next */
  short bk, sk;
end_producer:
  do
  :: atomic {
       ph == 0 && CAN_REQUEST(p) -> nreq++; i = nreq; st[i] = RESERVED; mid[p] = 1; used[p]++;
       choose_request(p, i); s = r_s[i];
       if
       :: d_step { publish(p, i) }                  /* a blind write */
       :: CAN_LOAD(p) ->
          /* load -> write: a two-step load, broker first (load_pending.lua's read of E[s]
           * and V), then the store (load.lua). When nothing happens between the two steps
           * it is the one-script load of a single Redis, so this covers that one too. */
          d_step {
            t0 = now; mask = 0; cmask = 0; xmask = 0;
            for (hq : 1 .. NREQ) {
              if :: st[hq] == ACCEPTED -> mask = mask | (1 << hq) :: else fi;
#ifdef WINDOW
              /* lost before the load began: it is not the load's to see, even if its
               * producer publishes it again meanwhile */
              if :: st[hq] == ACCEPTED && exempt[hq] -> xmask = xmask | (1 << hq) :: else fi;
#endif
              if :: COUNTS(hq) || SERVABLE(hq) -> cmask = cmask | (1 << hq) :: else fi
            }
#ifdef STORE_FIRST_LOAD
            store_read(s, sk, sc);
#else
            broker_read(s, bk, bc);
#ifdef DETECT
            /* the read's epoch and mark; a loss found: recover, then read again */
            hb = pm[p];
            observe(p, epoch, mark, hb, TOKEN_AT(mark), FORKED(pm[p], ptk[p]));
#ifdef WINDOW
            if :: hd -> recover(p); broker_read(s, bk, bc) :: else fi;
#endif
#endif
#endif
            ph = 1
          }
       fi
     }
  :: d_step {
       ph == 1;   /* (guards inside the d_steps: outside, each would be a state of its own) */
#ifdef STORE_FIRST_LOAD
       broker_read(s, bk, bc);
       MERGE(bk, bc, sk, sc, now, t0, hk, hc, ht);
#else
       store_read(s, sk, sc);
       if
       :: bk == -1 -> hk = -1
       :: else -> MERGE(bk, bc, sk, sc, t0, now, hk, hc, ht)
       fi;
#endif
       if
       :: hk == -1 ->
          /* PendingRecordMissing: the load refuses; the turn's write goes out blind */
          printf("t%d P%d load s%d (started t%d) -> refused: a record is missing\n", now, p, s, t0)
       :: else ->
          printf("t%d P%d load s%d (started t%d) -> seq %d ", now, p, s, t0, SEQ_OF(hk));
          if :: hk == 0 -> printf("(nothing)") :: hk % (2 * R) >= R -> printf("delete") :: else -> printf("save") fi;
          printf(" req %d value #%d\n", REQ_OF(hk), hc);
          check_load(s, hk, hc, ht, mask, cmask, xmask, p)
       fi;
       /* adopt the loaded key: F_p[s] = max(F_p[s], seq) */
       if
       :: hk > 0 && SEQ_OF(hk) > F[p * NSS + s] ->
#ifdef PROCESS_FLOOR
          for (hq : 1 .. NS) { F[p * NSS + hq] = SEQ_OF(hk) }
#else
          F[p * NSS + s] = SEQ_OF(hk)
#endif
       :: else
       fi;
       bk = 0; bc = 0; sk = 0; sc = 0; t0 = 0; mask = 0; cmask = 0; xmask = 0; ph = 2
     }
  :: d_step { ph == 2; publish(p, i); ph = 0 }     /* the write made from that load */
#ifdef LAST_LOAD
  :: d_step {
       /* P_OK's next call once its requests are made: a load of session 1, in one script
        * (load_pending.lua on one Redis); a loss it finds: recover, then read again.
        * Finding 7's aware client, calling after the loss and the unaware publishes. */
       ph == 0 && p == P_OK && !MAY_REQUEST(p) && !lastload;
       lastload = 1;
       broker_read(1, bk, bc);
#ifdef DETECT
       hb = pm[p];
       observe(p, epoch, mark, hb, TOKEN_AT(mark), FORKED(pm[p], ptk[p]));
#ifdef WINDOW
       if :: hd -> recover(p); broker_read(1, bk, bc) :: else fi;
#endif
#endif
       store_read(1, sk, sc);
       mask = 0; cmask = 0;
       for (hq : 1 .. NREQ) {
         if :: st[hq] == ACCEPTED -> mask = mask | (1 << hq) :: else fi;
         if :: COUNTS(hq) || SERVABLE(hq) -> cmask = cmask | (1 << hq) :: else fi
       }
       if
       :: bk == -1 -> printf("t%d P%d load s1 -> refused: a record is missing\n", now, p)
       :: else ->
          MERGE(bk, bc, sk, sc, now, now, hk, hc, ht);
          printf("t%d P%d load s1 -> seq %d req %d value #%d\n", now, p, SEQ_OF(hk), REQ_OF(hk), hc);
          check_load(1, hk, hc, ht, mask, cmask, 0, p)
       fi;
       bk = 0; bc = 0; sk = 0; sc = 0; mask = 0; cmask = 0
     }
#endif
  od
  /* no `break`: a producer with nothing left to do blocks at the top of its loop (a valid
   * end state), rather than doubling the states with "ended or not yet" */
}

/* ------------------------------------------------------------------------------------ */
/* Workers (tasks/checkpoints.py, worker/coalesce.py; store/lua/save.lua, delete.lua;    */
/* tasks/lua/settle.lua)                                                                  */

/* Refused / dead-lettered: a refusal record keyed (session, req). Only the request's own
 * producer's fault, or the loss of the broker's data, may refuse a request (d). */
inline dead_letter(i, ownfault) {
  printf(" -> refused (dead letter)\n");
  refused[i] = 1; own[i] = ownfault; rr[KSV(i)] = 1;
  hok = (ownfault || exempt[i]);
  if :: !hok -> printf("VIOLATION (d): #%d refused, not for its own producer's fault\n", i) :: else fi;
  d_worker_refusal = hok; assert(d_worker_refusal)         /* (d): refused only for its own producer's fault */
}

#ifdef NO_LIFETIME
#define NOT_LAPSED(i) true
#else
#define NOT_LAPSED(i) (now < r_dl[i])
#endif

/* apply(r) at the servers' clock N = now; vc: the value the worker holds for a save
 * (a plain save's is in its message; a staged one's was read from V, 0 if missing). */
inline apply(i, vc) {
  hs = r_s[i]; hk = r_key[i];
  printf("t%d worker applies ", now); say(i);
  if
  :: r_seq[i] > now * K + L * K ->
     dead_letter(i, FAST_FAULT(r_p[i]))             /* 1. "seq too far ahead" (tasks/seq.py) */
  :: else ->
  if
  :: r_bad[i] -> dead_letter(i, 1)                  /* 1. bad input */
#ifndef NO_LIFETIME
  :: !r_bad[i] && r_op[i] == SAVE && now >= r_dl[i] ->
     /* 2. lapse (delete.lua with ARGV[5] = '2'): fences it as a lapsed save if it is ordered
      * after the fence; the value goes. Outcome "expired", never a dead letter. */
     if
     :: hk > f_key[hs] ->
        val[hs] = 0; val_dl[hs] = 0;
        f_key[hs] = hk; f_lap[hs] = 1;
        f_exp[hs] = ((now > r_dl[i]) -> now : r_dl[i]) + TOMB;
        hit[i] = 1;
        printf(" -> lapsed: fence = it, lapsed, until t%d\n", f_exp[hs])
     :: else -> printf(" -> lapsed (stale)\n")
     fi
#endif
  :: !r_bad[i] && r_op[i] == SAVE && NOT_LAPSED(i) ->
     /* 3. save.lua: applies iff k(r) > k(fence), or == (a duplicate) */
     if
     :: hk < f_key[hs] -> printf(" -> stale\n")      /* superseded */
     :: else ->
        if
        :: vc == 0 ->
           /* 4. staged value missing: stale if the fence shows it applied, else lost */
           if
           :: hk == f_key[hs] -> printf(" -> stale (value gone, fence shows it)\n")
           :: else -> dead_letter(i, r_rq[i] != i)   /* "value lost"; its fault if it took another's id */
           fi
        :: else ->
           val[hs] = vc;
#ifdef NO_LIFETIME
           /* v1: a fresh TTL from the apply (never shorter than the deadline, so that only
            * the missing lapse rule shows) */
           val_dl[hs] = ((now + TTL > r_dl[i]) -> now + TTL : r_dl[i]);
#else
           val_dl[hs] = r_dl[i];
#endif
           f_key[hs] = hk; f_lap[hs] = 0; f_exp[hs] = val_dl[hs] + TOMB;
           applied[i] = 1; hit[i] = 1;
           printf(" -> applied: value #%d until t%d, fence until t%d\n", vc, val_dl[hs], f_exp[hs])
        fi
     fi
  :: !r_bad[i] && r_op[i] == DEL ->
     /* 3. delete.lua: applies iff k(r) >= k(fence); tombstone until
      * max(N, deadline(r)) + TOMB */
     if
     :: hk >= f_key[hs] ->
        val[hs] = 0; val_dl[hs] = 0;
        f_key[hs] = hk; f_lap[hs] = 0;
#ifdef SHORT_TOMBSTONE
        f_exp[hs] = now + SHORT_TOMB;
#else
        f_exp[hs] = ((now > r_dl[i]) -> now : r_dl[i]) + TOMB;
#endif
        applied[i] = 1; hit[i] = 1;
        printf(" -> applied: tombstone until t%d\n", f_exp[hs])
     :: else -> printf(" -> stale\n")
     fi
  fi
  fi
}

/* settle.lua: remove exactly r's entry (HDEL E[s] r.req) and V[s, r.req]; nothing else. */
inline settle(i) {
  hs = r_s[i];
  printf("t%d worker settles #%d\n", now, i);
#if defined(WINDOW) && !defined(SETTLE_ANY_DELIVERY)
  if
  :: wst[w] -> printf("t%d   (a later publish's records: left to its message)\n", now)
  :: else ->
#endif
#ifdef SETTLE_BY_SEQ
  /* v1: every entry of the session with seq <= the settled request's */
  for (hq : 1 .. NREQ) {
    if
    :: e_on[hq] && r_s[e_slot[hq]] == hs && r_seq[e_slot[hq]] <= r_seq[i] ->
       e_on[hq] = 0; e_slot[hq] = 0
    :: else
    fi
  }
#else
  hq = KSE(i);
#ifdef RECORD_LOSS
  /* a removed entry counts one less */
  if
  :: e_on[hq] -> if :: cnt[hs] > 0 -> cnt[hs]-- :: else fi
  :: else ->
#ifdef COUNTED_IDS
     /* a missing one only if it is its own and still counted, once */
     if :: elost[i] && cnt[hs] > 0 -> elost[i] = 0; cnt[hs]-- :: else fi
#else
     /* the rule before the counted requests: a missing one whenever the count expects one
      * (a redelivered duplicate spends another's: README, finding 6) */
     hn = 0;
     for (hw : 1 .. NREQ) { if :: e_on[hw] && r_s[e_slot[hw]] == hs -> hn++ :: else fi };
     if :: cnt[hs] > hn -> cnt[hs]-- :: else fi;
     hw = 0
#endif
  fi;
  e_on[hq] = 0; e_slot[hq] = 0;
  /* the session leaves the index once no entry is left and its count is spent */
  hn = 0;
  for (hw : 1 .. NREQ) { if :: e_on[hw] && r_s[e_slot[hw]] == hs -> hn++ :: else fi };
  if :: hn == 0 && cnt[hs] == 0 -> idx[hs] = 0 :: else fi;
  hw = 0;
#else
  e_on[hq] = 0; e_slot[hq] = 0;
#endif
#endif
  hq = KSV(i); v_on[hq] = 0; v_slot[hq] = 0
#if defined(WINDOW) && !defined(SETTLE_ANY_DELIVERY)
  fi
#endif
}

inline pick_queued(i) {
  if
  :: msg[1] == QUEUED -> i = 1
  :: msg[2] == QUEUED -> i = 2
#if NREQ >= 3
  :: msg[3] == QUEUED -> i = 3
#endif
#if NREQ >= 4
  :: msg[4] == QUEUED -> i = 4
#endif
#if NREQ >= 5
  :: msg[5] == QUEUED -> i = 5
#endif
  fi
}

/* take -> [crash] -> apply -> [crash] -> settle -> [crash] -> ack. A crash leaves the
 * message in unacked (the broker restores it after VT). Settle and ack run as one step
 * (the coalesced path's pipeline) unless the worker crashes between them (the task path):
 * a live worker between the two is observably the same as a crashed one whose message is
 * still unacked, so that state is not explored twice. CRASHES bounds the crashes of a run. */
/* A crash: the message stays in unacked, and the broker restores it to the queue after VT.
 * Nothing tells a message waiting in unacked from one waiting in the queue (loads do not
 * read either; a loss takes both), so the crash puts it back at once: the wait for VT is
 * any time it then spends queued. (With NW > 1 the broker also restores a message that a
 * live worker still holds: a slow worker overtaken by VT.) */
#define CRASH(w, i) \
  printf("t%d worker %d crashes holding #%d (redelivered after VT)\n", now, w, i); \
  if :: msg[i] == UNACKED -> msg[i] = QUEUED :: else fi; \
  wcur[w] = 0; FRESH(w); i = 0
#ifdef CRASHES
#define CAN_CRASH (crashes < CRASHES)
#define COUNT_CRASH crashes++
#else
#define CAN_CRASH true   /* unbounded: a counter would only split equal states */
#define COUNT_CRASH skip
#endif
proctype worker(byte w) {
  byte i;
end_idle:
  do
  :: atomic { pick_queued(i); msg[i] = UNACKED; wcur[w] = i; printf("t%d worker %d takes #%d\n", now, w, i) };
     if
     :: d_step {
          /* a staged save's value is read from V (0: missing); a plain save's is in its
           * message. (Read and store write are one step here: with broker != store they
           * are two, but nothing between them changes the outcome: V[s, req] can only go
           * with the request's own settle or the broker's data, as if just before the read.) */
          if
          :: r_op[i] == SAVE && r_stg[i] -> hv = (v_on[KSV(i)] -> v_slot[KSV(i)] : 0)
          :: else -> hv = i
          fi;
          apply(i, hv)
        };
        if
        :: d_step {                                        /* settle + ack */
             settle(i);
             if :: msg[i] == UNACKED -> msg[i] = ACKED :: else fi;
             printf("t%d worker %d acks #%d\n", now, w, i);
             wcur[w] = 0; FRESH(w); i = 0
           }
        :: d_step {                                        /* crash after the store write */
             CAN_CRASH; COUNT_CRASH;
             CRASH(w, i)
           }
        :: d_step {                                        /* crash between settle and ack */
             CAN_CRASH; COUNT_CRASH; settle(i);
             CRASH(w, i)
           }
        fi
     :: d_step {                                           /* crash before the store write */
          CAN_CRASH; COUNT_CRASH;
          CRASH(w, i)
        }
     fi
  od
}

/* ------------------------------------------------------------------------------------ */
/* The environment: the broker's redelivery and data loss; the clock and expiries.       */

/* Redelivery: a crashed worker's message is restored by the crash itself (see CRASH); with
 * NW > 1 the broker may also restore a message a live worker still holds (a slow worker
 * overtaken by VT), at any moment, which includes every real VT. Loss: the queue, unacked,
 * E, V and the index go; the epoch changes. A request lost before it was applied is exempt
 * from (a) and (c). (A loss of an empty broker changes nothing but the epoch: not explored.) */
#define QUEUED_(i) ((i) <= NREQ && msg[i] == QUEUED)
#define ENTRY_ON (e_on[1] || e_on[2] || ((NREQ >= 3) && e_on[3]) || ((NREQ >= 4) && e_on[4]))
#ifdef SWEEP_QUEUE_ONLY
#define GONE(m) ((m) == PURGED || (m) == LOST || (m) == UNACKED)
#else
#define GONE(m) ((m) == PURGED || (m) == LOST)
#endif
#define ORPHAN(q) ((q) <= NREQ && e_on[q] && GONE(msg[e_slot[q]]))

#ifdef SUFFIX_LOSS
/* Undo the publish of mark `mark`: its message (queued or unacked) is lost, its entry and
 * value go, and the mark goes back one; back to 0, the epoch goes too (both were written
 * by the first publish). What workers did after that publish to older requests stands (the
 * model's abstraction: README.md). */
inline lose_last() {
  for (hq : 1 .. NREQ) {
    if
    :: st[hq] == ACCEPTED && r_mk[hq] == mark ->
       printf("t%d   publish %d of #%d undone\n", now, mark, hq);
       if
       :: msg[hq] == QUEUED || msg[hq] == UNACKED ->
          msg[hq] = LOST; if :: !hit[hq] -> exempt[hq] = 1 :: else fi
       :: else
       fi;
       if
       :: e_on[hq] && e_slot[hq] == hq ->
          e_on[hq] = 0; e_slot[hq] = 0;
#ifdef RECORD_LOSS
          if :: cnt[r_s[hq]] > 0 -> cnt[r_s[hq]]-- :: else fi
#else
          skip
#endif
       :: else
       fi;
#ifdef COUNTED_IDS
       /* its publish undone: its count and its counted request with it */
       if :: elost[hq] -> elost[hq] = 0; if :: cnt[r_s[hq]] > 0 -> cnt[r_s[hq]]-- :: else fi :: else fi;
#endif
       if :: v_on[hq] && v_slot[hq] == hq -> v_on[hq] = 0; v_slot[hq] = 0 :: else fi
    :: else
    fi
  }
  rt[mark] = 0;     /* its slot's write undone with it */
  mark--;
  if :: mark == 0 -> epoch = 0 :: else fi;
  hq = 0
}
#endif

#define UNACKED_(i) ((i) <= NREQ && msg[i] == UNACKED)
#define HOLDS(i) ((i) <= NREQ && (msg[i] == QUEUED || msg[i] == UNACKED || e_on[i] || v_on[i]))
#define BROKER_HOLDS_SOMETHING (HOLDS(1) || HOLDS(2) || HOLDS(3) || HOLDS(4) || HOLDS(5))
active proctype broker() {
end_broker:
  do
  :: d_step {
       NW > 1 && (UNACKED_(1) || UNACKED_(2) || UNACKED_(3) || UNACKED_(4) || UNACKED_(5));
       if
       :: msg[1] == UNACKED -> msg[1] = QUEUED; printf("t%d broker redelivers #1\n", now)
       :: msg[2] == UNACKED -> msg[2] = QUEUED; printf("t%d broker redelivers #2\n", now)
#if NREQ >= 3
       :: msg[3] == UNACKED -> msg[3] = QUEUED; printf("t%d broker redelivers #3\n", now)
#endif
#if NREQ >= 4
       :: msg[4] == UNACKED -> msg[4] = QUEUED; printf("t%d broker redelivers #4\n", now)
#endif
#if NREQ >= 5
       :: msg[5] == UNACKED -> msg[5] = QUEUED; printf("t%d broker redelivers #5\n", now)
#endif
       fi
     }
  :: d_step {
       losses < LOSSES && BROKER_HOLDS_SOMETHING;
       losses++;
       printf("t%d BROKER LOSES ITS DATA (epoch changes)\n", now);
       for (hq : 1 .. NREQ) {
         if
         :: msg[hq] == QUEUED || msg[hq] == UNACKED ->
            msg[hq] = LOST; if :: !hit[hq] -> exempt[hq] = 1 :: else fi
         :: else
         fi;
         e_on[hq] = 0; e_slot[hq] = 0; v_on[hq] = 0; v_slot[hq] = 0
       }
#ifdef DETECT
       mark = 0; epoch = 0;
       for (hq : 0 .. MMAX - 1) { rt[hq] = 0 }
#endif
#ifdef RECORD_LOSS
       for (hq : 1 .. NS) { cnt[hq] = 0; idx[hq] = 0 }
#endif
#ifdef COUNTED_IDS
       for (hq : 1 .. NREQ) { elost[hq] = 0 }
#endif
       hq = 0     /* (a d_step must not end in a loop: Spin 6.5 loses the exit label) */
     }
#ifdef SUFFIX_LOSS
  :: atomic {
       /* the broker goes back in time (a crash inside its fsync window, a failover to a
        * lagging replica): the last publishes, one or more, are undone */
       losses < LOSSES && mark > 0 -> losses++;
       printf("t%d BROKER GOES BACK IN TIME\n", now);
       d_step { lose_last() };
       do
       :: d_step { mark > 0; lose_last() }
       :: break
       od
     }
#endif
#ifdef RECORD_LOSS
  :: atomic {
       /* an operator's DEL of an entry (or eviction): its message stays queued */
       !rlost && ENTRY_ON -> rlost = 1;
       if
       :: e_on[1] -> hq = 1
       :: e_on[2] -> hq = 2
#if NREQ >= 3
       :: e_on[3] -> hq = 3
#endif
#if NREQ >= 4
       :: e_on[4] -> hq = 4
#endif
       fi;
       d_step {
         printf("t%d the entry of #%d is lost, its message stays\n", now, e_slot[hq]);
#ifdef COUNTED_IDS
         elost[e_slot[hq]] = 1;
#endif
         e_on[hq] = 0; e_slot[hq] = 0; hq = 0
       }
     }
#endif
#ifdef PURGE
  :: d_step {
       /* a purge (celery purge, DEL of the queue): the queued messages go, records stay */
       !purged && (QUEUED_(1) || QUEUED_(2) || QUEUED_(3) || QUEUED_(4));
       purged = 1;
       printf("t%d the queue is purged\n", now);
       for (hq : 1 .. NREQ) {
         if :: msg[hq] == QUEUED -> msg[hq] = PURGED; if :: !hit[hq] -> exempt[hq] = 1 :: else fi :: else fi
       }
       hq = 0
     }
  :: atomic {
       /* the sweep (tasks/orphans.py): an entry whose message is in neither the queue nor
        * unacked is settled as lost: the entry, its value, a refusal record of kind lost */
       ORPHAN(1) || ORPHAN(2) || ORPHAN(3) || ORPHAN(4) ->
       if
       :: ORPHAN(1) -> hq = 1
       :: ORPHAN(2) -> hq = 2
       :: ORPHAN(3) -> hq = 3
       :: ORPHAN(4) -> hq = 4
       fi;
       d_step {
         hw = e_slot[hq];
         printf("t%d the sweep settles #%d as lost\n", now, hw);
#ifdef RECORD_LOSS
         if :: cnt[r_s[hw]] > 0 -> cnt[r_s[hw]]-- :: else fi;
#endif
         e_on[hq] = 0; e_slot[hq] = 0;
         if :: v_on[KSV(hw)] && v_slot[KSV(hw)] == hw -> v_on[KSV(hw)] = 0; v_slot[KSV(hw)] = 0 :: else fi;
         lostrec[hw] = 1; hq = 0; hw = 0
       }
     }
#endif
  od
}

/* Time: a tick; then every expiry due: E[s] (at the max deadline of its entries: the
 * hash's expiry is kept at that; were a settle not to shorten it, the entries past their
 * deadlines it kept would answer as the store does, "absent"), values in V (at their
 * request's deadline), the store's values (the sweep; invisible from their deadline
 * anyway), fences and tombstones. */
active proctype clock() {
end_clock:
  do
  :: d_step {
       now < TMAX;    /* (a guard inside the d_step: outside it, it is a state of its own) */
       now++;
       printf("tick -> t%d\n", now);
       for (hs : 1 .. NS) {
         hc = 0;
         for (hq : 1 .. NREQ) {
           if :: e_on[hq] && r_s[e_slot[hq]] == hs && r_dl[e_slot[hq]] > hc -> hc = r_dl[e_slot[hq]] :: else fi
         }
         if
         :: hc != 0 && hc <= now ->
            for (hq : 1 .. NREQ) {
              if :: e_on[hq] && r_s[e_slot[hq]] == hs -> e_on[hq] = 0; e_slot[hq] = 0 :: else fi
            }
         :: else
         fi;
         if :: val[hs] != 0 && val_dl[hs] <= now -> val[hs] = 0; val_dl[hs] = 0 :: else fi;
#ifdef RECORD_LOSS
         /* a stale index entry: publish.lua resets its count (read_pending.lua ignores it) */
         if
         :: idx[hs] != 0 && idx[hs] <= now -> idx[hs] = 0; cnt[hs] = 0;
#ifdef COUNTED_IDS
            /* the counted requests expire with the index (the same latest deadline) */
            for (hq : 1 .. NREQ) { if :: r_s[hq] == hs -> elost[hq] = 0 :: else fi };
#endif
            skip
         :: else
         fi;
#endif
         if :: f_key[hs] != 0 && f_exp[hs] <= now -> f_key[hs] = 0; f_lap[hs] = 0; f_exp[hs] = 0 :: else fi
       }
       for (hq : 1 .. NREQ) {
         if :: v_on[hq] && r_dl[v_slot[hq]] <= now -> v_on[hq] = 0; v_slot[hq] = 0 :: else fi
       }
       hq = 0
     }
  od
}

/* ------------------------------------------------------------------------------------ */
/* The monitor: at every state, an atomic load of each session (load_pending.lua, broker
 * and store one Redis), wait_durable of every accepted request, and at quiescence the
 * final state (c). */
active proctype monitor() {
end_monitor:
  do
  :: d_step {
       for (hm : 1 .. NS) {
         /* an atomic load: broker_read then store_read in one step */
         hk = 0; hc = 0;
         for (hq : 1 .. NREQ) {
           if
           :: e_on[hq] && r_s[e_slot[hq]] == hm && r_key[e_slot[hq]] > hk ->
              hk = r_key[e_slot[hq]]; ht = e_slot[hq]
           :: else
           fi
         }
         if
         :: hk != 0 && r_op[ht] == SAVE && now < r_dl[ht] && v_on[KSV(ht)] -> hc = v_slot[KSV(ht)]
         :: else -> hc = 0
         fi;
         if
         :: hk <= f_key[hm] ->
            hk = f_key[hm]; hc = ((val[hm] != 0 && now < val_dl[hm]) -> val[hm] : 0)
         :: else
         fi;
         MISSING(hm, hk, hc);    /* a load that finds a record missing refuses: nothing to check */
         if :: hk != -1 -> check_load(hm, hk, hc, now, 255, 0, 0, NP) :: else fi
       }
       /* wait_durable(r) for every accepted request: applied iff fence.req == r.req (not
        * lapsed); expired iff that fence is lapsed, or fence < r and now >= deadline(r);
        * superseded iff fence > r; refused iff a refusal record (s, req); else pending. */
       for (hw : 1 .. NREQ) {
         if
         :: st[hw] == ACCEPTED && PROTECTED(hw) ->
            hs = r_s[hw];
            if
            :: f_key[hs] != 0 && REQ_OF(f_key[hs]) == r_rq[hw] ->
               if
               :: !f_lap[hs] -> hok = applied[hw];
                  if :: !hok -> printf("VIOLATION (d): wait_durable(#%d) says applied; it was not\n", hw) :: else fi;
                  d_applied_true = hok; assert(d_applied_true)   /* (d) "applied" is true */
               :: else
               fi
            :: else ->
               if
               :: f_key[hs] < r_key[hw] && now >= r_dl[hw] -> skip          /* expired */
               :: f_key[hs] > r_key[hw] -> skip                              /* superseded */
               :: else ->
                  if
                  :: rr[KSV(hw)] -> hok = refused[hw];
                     if :: !hok -> printf("VIOLATION (d): wait_durable(#%d) says refused; it was not\n", hw) :: else fi;
                     d_refused_true = hok; assert(d_refused_true)  /* (d) "refused" is true */
#ifdef PURGE
                  :: !rr[KSV(hw)] && lostrec[hw] ->
                     /* "lost": its message was gone (purged, or lost with the broker's
                      * data), and it was never applied */
                     hok = !applied[hw] && (msg[hw] == PURGED || msg[hw] == LOST || exempt[hw]);
                     if :: !hok -> printf("VIOLATION (d): wait_durable(#%d) says lost; it was not\n", hw) :: else fi;
                     d_lost_true = hok; assert(d_lost_true)    /* (d) "lost" is true */
#endif
                  :: else
                  fi
               fi
            fi
         :: else
         fi
       }
       /* (c) once everything settled: nothing queued, unacked or held by a worker */
       hquiet = true;
       for (hq : 1 .. NREQ) {
         if :: msg[hq] == QUEUED || msg[hq] == UNACKED -> hquiet = false :: else fi
       }
       for (hq : 0 .. NW - 1) { if :: wcur[hq] != 0 -> hquiet = false :: else fi }
#ifdef PURGE
       /* and the sweep has settled every entry whose message is gone */
       if :: ORPHAN(1) || ORPHAN(2) || ORPHAN(3) || ORPHAN(4) -> hquiet = false :: else fi;
#endif
       if
       :: hquiet ->
          for (hm : 1 .. NS) {
            /* T: the max-key accepted request not refused for its own producer's fault,
             * lost ones only if they were applied anyway */
            hk = 0; ht = 0;
            for (hq : 1 .. NREQ) {
              if
              :: st[hq] == ACCEPTED && r_s[hq] == hm && !own[hq] && (!exempt[hq] || hit[hq]) &&
                 r_key[hq] > hk -> hk = r_key[hq]; ht = hq
              :: else
              fi
            }
            hc = ((val[hm] != 0 && now < val_dl[hm]) -> val[hm] : 0);
            /* value iff T is a save not past its deadline, and then T's value */
            if
            :: ht != 0 && r_op[ht] == SAVE && now < r_dl[ht] -> hok = (hc == ht)
            :: else -> hok = (hc == 0)
            fi;
#ifdef STRICT_FENCE
            /* stronger than the spec: the fence, while it lasts, names T itself */
            if :: f_key[hm] != 0 && f_key[hm] != hk -> hok = false :: else fi;
#endif
            if :: !hok -> printf("VIOLATION (c): all settled, s%d serves value #%d; the last accepted request is #%d\n", hm, hc, ht) :: else fi;
            c_final_state = hok; assert(c_final_state)   /* (c) the final state */
          }
       :: else
       fi
     }
  od
}

init {
  byte w;
  atomic {
    skew[P_OK] = 0; skew[P_FAST] = L / 2 + 1; skew[P_SLOW] = -TTL; skew[P_EVIL] = L / 2;
    skew[P_AHEAD] = L / 2;
    if :: Q_OK > 0 -> run producer(P_OK) :: else fi;
    if :: Q_AHEAD > 0 -> run producer(P_AHEAD) :: else fi;
    if :: Q_SLOW > 0 -> run producer(P_SLOW) :: else fi;
    if :: Q_FAST > 0 -> run producer(P_FAST) :: else fi;
    if :: Q_EVIL > 0 -> run producer(P_EVIL) :: else fi;
#if Q_OTHER > 0
    skew[P_OTHER] = 0; run producer(P_OTHER);
#endif
    for (w : 0 .. NW - 1) { run worker(w) }
  }
}
