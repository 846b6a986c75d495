/* kvferryctl - asks the local kvferryd what it is doing.
 *
 *   kvferryctl [-s SOCKET] [--json] status|pools|peers|transfers|layouts|metrics|doctor
 *   kvferryctl [-s SOCKET] [--json] transfers --trace
 *
 * The daemon renders the status, pools, peers, transfers and layouts tables and
 * their JSON; this tool forwards the question and prints the answer.
 * metrics reads the daemon's Prometheus endpoint, doctor runs the node
 * checks (ctl_doctor.c). Options may come before or after the command
 * (getopt_long).
 * Exit statuses are in ctl.h and kvferryctl(1). */
#include "ctl.h"
#include "kvferry.h"

#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_SOCKET "/run/kvferry/kvferryd.sock"

#define SYNOPSIS "kvferryctl [-s SOCKET] [--json] COMMAND"

enum { EXIT_OK = CTL_OK, EXIT_DAEMON = CTL_ERROR, EXIT_USAGE = CTL_USAGE };

struct command {
  const char *name;
  int what;                                   /* enum kvf_inspect, for inspect views */
  int (*run)(const char *socket, bool json);  /* else this */
  const char *help;
};

static const struct command commands[] = {
  {"status", KVF_INSPECT_STATUS, NULL, "the daemon: node, version, transports, counters"},
  {"pools", KVF_INSPECT_POOLS, NULL, "memory pools and how they are registered"},
  {"peers", KVF_INSPECT_PEERS, NULL, "peer daemons and the state of each connection"},
  {"transfers", KVF_INSPECT_TRANSFERS, NULL, "active grants and sends, with their path"},
  {"layouts", KVF_INSPECT_LAYOUTS, NULL, "KV cache layouts the node's clients registered"},
  {"metrics", -1, ctl_metrics, "the daemon's Prometheus metrics (--json: parsed)"},
  {"doctor", -1, ctl_doctor, "check this node for what kvferryd needs"},
};

#define N_COMMANDS (sizeof(commands) / sizeof(commands[0]))

struct options {
  const char *socket;
  bool json;
  bool trace;                                 /* transfers: the finished ones' timelines */
  bool help;
  const char *command;
};

static void usage(FILE *f) {
  fprintf(f,
          "usage: " SYNOPSIS "\n"
          "\n"
          "Options (before or after COMMAND):\n"
          "  -s, --socket PATH  kvferryd's socket (default: $KVFERRY_SOCKET,\n"
          "                     else " DEFAULT_SOCKET ")\n"
          "  --json             print JSON instead of a table\n"
          "  --checks NAME,...  doctor: only these checks (e.g. a readiness probe:\n"
          "                     --checks socket,pools-locked,registry)\n"
          "  --trace            transfers: the last 1024 finished transfers and where\n"
          "                     their time went (hops in us)\n"
          "  -h, --help         print this help\n"
          "\n"
          "Commands:\n");
  for (size_t i = 0; i < N_COMMANDS; i++)
    fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].help);
  fprintf(f, "\nExit status: 0 success, 1 the daemon answered with an error (or metrics are\n"
             "off), 2 usage error, 3 no daemon answers on the socket, 4 doctor: a check\n"
             "failed.\n");
}

/* Prints "kvferryctl: PROBLEM [ARG]" and where to find help, to stderr. */
static int usage_error(const char *problem, const char *arg) {
  fprintf(stderr, "kvferryctl: %s%s%s\n", problem, arg ? " " : "", arg ? arg : "");
  fprintf(stderr, "usage: " SYNOPSIS "\nTry 'kvferryctl --help'.\n");
  return EXIT_USAGE;
}

/* Fills opt from argv with getopt_long, as kvferryd parses its own: GNU
 * order (options before or after COMMAND, "--" ends them, --socket=PATH,
 * unambiguous abbreviations). Returns EXIT_OK or EXIT_USAGE (message
 * printed). */
static int parse_args(int argc, char **argv, struct options *opt) {
  enum { OPT_JSON = 0x100, OPT_CHECKS, OPT_TRACE };
  static const struct option longopts[] = {{"socket", required_argument, NULL, 's'},
                                           {"json", no_argument, NULL, OPT_JSON},
                                           {"checks", required_argument, NULL, OPT_CHECKS},
                                           {"trace", no_argument, NULL, OPT_TRACE},
                                           {"help", no_argument, NULL, 'h'},
                                           {0}};
  int o;
  opterr = 0; /* our messages, "kvferryctl: ...", not getopt's "argv[0]: ..." */
  while ((o = getopt_long(argc, argv, ":s:h", longopts, NULL)) != -1) {
    switch (o) {
    case 's': opt->socket = optarg; break;
    case OPT_JSON: opt->json = true; break;
    case OPT_CHECKS:
      if (!ctl_doctor_select(optarg)) return usage_error("unknown doctor check in", optarg);
      break;
    case OPT_TRACE: opt->trace = true; break;
    case 'h': opt->help = true; break;
    case ':': return usage_error("missing path after", argv[optind - 1]);
    default: return usage_error("unknown option", argv[optind - 1]);
    }
  }
  if (optind < argc) opt->command = argv[optind++];
  if (optind < argc) return usage_error("unexpected argument", argv[optind]);
  if (opt->socket && !*opt->socket) return usage_error("empty socket path", NULL);
  return EXIT_OK;
}

static const struct command *find_command(const char *name) {
  for (size_t i = 0; i < N_COMMANDS; i++)
    if (strcmp(commands[i].name, name) == 0) return &commands[i];
  return NULL;
}

static const char *socket_path(const struct options *opt) {
  if (opt->socket) return opt->socket;
  const char *env = getenv("KVFERRY_SOCKET");
  return env && *env ? env : DEFAULT_SOCKET;
}

/* Prints the daemon's text as rendered, ending it with a newline if the
 * daemon did not, so that the shell prompt starts on its own line. */
int ctl_print(const char *text) {
  size_t n = strlen(text);
  fputs(text, stdout);
  if (n > 0 && text[n - 1] != '\n') fputc('\n', stdout);
  if (fflush(stdout) != 0 || ferror(stdout)) {
    fprintf(stderr, "kvferryctl: cannot write output\n");
    return EXIT_DAEMON;
  }
  return EXIT_OK;
}

static int run(const struct command *cmd, int what, const char *path, bool json) {
  kvf_client *c;
  int rc = kvf_connect(path, &c);
  if (rc < 0) {
    fprintf(stderr, "kvferryctl: cannot reach kvferryd at %s: %s\n", path, kvf_strerror(rc));
    return CTL_UNREACHABLE;
  }
  char *text = NULL;
  rc = kvf_inspect(c, what, json, &text);
  kvf_close(c);
  if (rc < 0) {
    fprintf(stderr, "kvferryctl: %s: %s (%s)\n", cmd->name, kvf_strerror(rc), kvf_err_name(rc));
    return EXIT_DAEMON;
  }
  int status = ctl_print(text);
  free(text);
  return status;
}

int main(int argc, char **argv) {
  struct options opt = {0};
  int rc = parse_args(argc, argv, &opt);
  if (rc != EXIT_OK) return rc;
  if (opt.help) {
    usage(stdout);
    return EXIT_OK;
  }
  if (!opt.command) return usage_error("missing COMMAND", NULL);
  const struct command *cmd = find_command(opt.command);
  if (!cmd) return usage_error("unknown command", opt.command);
  if (opt.trace && cmd->what != KVF_INSPECT_TRANSFERS) return usage_error("--trace goes with", "transfers");
  if (cmd->run) return cmd->run(socket_path(&opt), opt.json);
  return run(cmd, opt.trace ? KVF_INSPECT_TRACE : cmd->what, socket_path(&opt), opt.json);
}
