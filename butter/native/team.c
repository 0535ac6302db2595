/* butter/native/team.c: where the threads of a step's OpenMP team may run.
 *
 * llama.cpp computes a graph with `#pragma omp parallel` from the thread that calls
 * llama_decode (the backend's thread), and libgomp keeps one pool of threads per such
 * thread: every later parallel region from it, llama.cpp's and butter's kernels', runs on
 * the same OS threads, thread i of the team on pool thread i. So a parallel region run from
 * the backend's thread reaches exactly the threads of every later step, and an affinity
 * set there stays with them.
 *
 * Why pin at all: the team meets at a barrier after every operation, and two of its threads
 * on one core take turns at the scheduler's pace (milliseconds) at every barrier. Linux's
 * balancer does not always part them: beside a program at nice 19 on the other core (which
 * weighs almost nothing), both team threads were seen sharing one core for seconds on end
 * while the niced program had a core to itself (docs/concurrency.md, "On a busy machine").
 * A team that fills every allowed CPU gets one CPU per thread; a smaller team is left to
 * the scheduler, which then has a free core to move a thread to.
 *
 * The boundary with Python (ctypes): versioned by BUTTER_TEAM_ABI_VERSION, every caller
 * buffer comes with its size in bytes, and nothing is kept between calls.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define BUTTER_TEAM_ABI_VERSION 1

#define BUTTER_OK 0
#define BUTTER_E_SHORT (-1)
#define BUTTER_E_ARGUMENT (-2)
#define BUTTER_E_NO_OPENMP (-4)

int32_t butter_team_abi_version(void) { return BUTTER_TEAM_ABI_VERSION; }

/* Runs one parallel region of `n` threads from the calling thread. With `pin`, thread i
 * may then run on CPU cpus[i] only (n CPUs given); without, on any of the `n_cpus` CPUs
 * given. tids[i] gets thread i's kernel thread id, 0 where setting its affinity failed.
 * Returns the number of threads the region had, or a BUTTER_E_* status. */
int32_t butter_team_place(int32_t n, const int32_t *cpus, size_t cpus_bytes, int32_t n_cpus,
                          int32_t pin, int32_t *tids, size_t tids_bytes) {
#ifdef _OPENMP
    if (n < 1 || n_cpus < 1 || cpus == NULL || tids == NULL || (pin && n_cpus < n)) {
        return BUTTER_E_ARGUMENT;
    }
    if (cpus_bytes < (size_t)n_cpus * sizeof(int32_t) ||
        tids_bytes < (size_t)n * sizeof(int32_t)) {
        return BUTTER_E_SHORT;
    }
    for (int32_t i = 0; i < n_cpus; i++) {
        if (cpus[i] < 0 || cpus[i] >= CPU_SETSIZE) {
            return BUTTER_E_ARGUMENT;
        }
    }
    memset(tids, 0, (size_t)n * sizeof(int32_t));
    int32_t team = 0;
    #pragma omp parallel num_threads(n)
    {
        const int i = omp_get_thread_num();
        cpu_set_t mask;
        CPU_ZERO(&mask);
        if (pin) {
            CPU_SET(cpus[i], &mask);
        } else {
            for (int32_t c = 0; c < n_cpus; c++) {
                CPU_SET(cpus[c], &mask);
            }
        }
        const pid_t tid = (pid_t)syscall(SYS_gettid);
        if (sched_setaffinity(0, sizeof mask, &mask) == 0) {
            tids[i] = (int32_t)tid;
        }
        if (i == 0) {
            team = omp_get_num_threads();
        }
    }
    return team;
#else
    (void)n; (void)cpus; (void)cpus_bytes; (void)n_cpus; (void)pin; (void)tids;
    (void)tids_bytes;
    return BUTTER_E_NO_OPENMP;
#endif
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_team", NULL, -1,
                                    NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__team(void) { return PyModule_Create(&module); }
